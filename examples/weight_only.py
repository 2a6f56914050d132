"""quantize_weights(): int4 weights (blocks of 32 rows) that ONNX Runtime runs as MatMulNBits.

    python examples/weight_only.py                              # a decoder-style MLP stack, hidden 1024
    python examples/weight_only.py --hidden 256 --layers 2 --output int4.onnx --seconds 0.2

Weight-only quantization keeps the activations float and stores each MatMul weight as 4-bit
integers with one scale per block: what LLMs and other memory-bound transformers ship. The model
here is ``layers`` blocks of ``x + MatMul(Gelu(MatMul(x, W_up)), W_down)`` on one token, FP32 at
opset 21; ``quantize_weights(model)`` (or a path: a model over 2 GB is read one weight at a time,
see large_model.py) returns ``DequantizeLinear(int4) -> MatMul``, which ORT fuses into
``com.microsoft.MatMulNBits``. Prints the ops ORT runs, the size, the output's cosine against FP32 and
the latency of both (one thread, interleaved, median).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import kenosis_rewrite


def mlp_stack(hidden: int, layers: int, seed: int = 0) -> onnx.ModelProto:
    """``layers`` residual MLP blocks (up-projection 4x, Gelu, down-projection) on ``x[1, 1, hidden]``."""
    rng = np.random.default_rng(seed)
    nodes, weights, x = [], [], "x"
    for i in range(layers):
        for name, shape in ((f"up{i}", (hidden, 4 * hidden)), (f"down{i}", (4 * hidden, hidden))):
            weights.append(numpy_helper.from_array(rng.normal(0, shape[0] ** -0.5, shape).astype(np.float32), name))
        nodes += [helper.make_node("MatMul", [x, f"up{i}"], [f"u{i}"]), helper.make_node("Gelu", [f"u{i}"], [f"g{i}"]),
                  helper.make_node("MatMul", [f"g{i}", f"down{i}"], [f"d{i}"]),
                  helper.make_node("Add", [x, f"d{i}"], [f"y{i}"])]
        x = f"y{i}"
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 1, hidden]) for name in ("x", x)]
    graph = helper.make_graph(nodes, "mlp_stack", io[:1], io[1:], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def session(model: onnx.ModelProto, optimized_path: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    options.log_severity_level = 3
    if optimized_path:
        options.optimized_model_filepath = optimized_path  # ORT writes the graph it runs there
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_ms(sessions: dict, feed: dict, seconds: float) -> dict[str, float]:
    """Median latency per session: runs interleaved for ``seconds`` each (20 at least) after a warm-up."""
    times = {name: [] for name in sessions}
    for run in sessions.values():
        run.run(None, feed)
    deadline = time.perf_counter() + seconds * len(sessions)
    while len(times[next(iter(times))]) < 20 or time.perf_counter() < deadline:
        for name, run in sessions.items():
            start = time.perf_counter()
            run.run(None, feed)
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per model")
    parser.add_argument("--output", help="save the int4 model here")
    args = parser.parse_args(argv)

    model = mlp_stack(args.hidden, args.layers)
    int4 = kenosis_rewrite.quantize_weights(model, bits=4, block_size=32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        sessions = {"FP32": session(model), "int4 weights": session(int4, path)}
        ran = collections.Counter(node.op_type for node in onnx.load(path).graph.node)
    print(f"quantize_weights() wrote: {dict(collections.Counter(node.op_type for node in int4.graph.node))}")
    print(f"ORT runs:                 {dict(ran)}\n")

    feed = {"x": np.random.default_rng(1).standard_normal((1, 1, args.hidden)).astype(np.float32)}
    expected, got = (sessions[name].run(None, feed)[0].ravel().astype(np.float64) for name in sessions)
    cosine = expected @ got / (np.linalg.norm(expected) * np.linalg.norm(got))
    latency = median_ms(sessions, feed, args.seconds)
    print("| model | MB | median ms | x FP32 |")
    print("|---|---:|---:|---:|")
    for name, proto in (("FP32", model), ("int4 weights", int4)):
        speed = latency["FP32"] / latency[name]
        print(f"| {name} | {proto.ByteSize() / 1e6:.2f} | {latency[name]:.3f} | {speed:.2f} |")
    print(f"\noutput cosine, int4 weights vs FP32: {cosine:.5f}")
    if args.output:
        kenosis_rewrite.save(int4, args.output)
        print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
