"""Benchmark: a model over 2 GB (external data) through quantize_weights() and fix(), vs onnxruntime.

    python benchmarks/large_model.py DIR [--layers 40] [--hidden 4096] [--keep]

Builds ``DIR/big.onnx``: an MLP of ``--layers`` blocks ``MatMul(W[h, h]) -> Add(bias) -> Relu`` on
``x[1, 1, h]`` (a decoder's activations at batch 1, one token), FP32 weights in the external file
``DIR/big.data`` (40 x 4096 x 4096: 2.7 GB), written one weight at a time. Then each step runs in
its own Python process (peak RSS from ``os.wait4``'s rusage, wall time around the child):

* onnxruntime's ``MatMulNBitsQuantizer`` (4 bits, block 32, its default: asymmetric round-to-nearest),
  saved with external data;
* ``kenosis-rewrite quantize-weights`` on the same file, 4 bits, block 32: ``--rtn`` (symmetric
  absmax round-to-nearest), ``--rtn --asymmetric`` (ORT's algorithm), and the default (per-block
  scale search, 19 clipping ratios: more accurate, slower);
* ``kenosis-rewrite fix`` on the ``--rtn`` output (QDQ form: DequantizeLinear(int4, block) -> MatMul)
  and on ORT's output (MatMulNBits form: left unchanged with a note);
* ``kenosis-rewrite explain`` on the FP32 model and on the ``--rtn`` output (ONNX Runtime builds a
  session from the path, so it holds the model itself).

It then loads the ``--rtn`` output in ORT, counts MatMulNBits in the optimized graph and compares one
output against the FP32 model. Prints a markdown table; big files are deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper


def build(directory: str, layers: int, hidden: int, seed: int = 0, *, bias: bool = True, rank: int = 3,
          stem: str = "big") -> str:
    """``directory/{stem}.onnx``: ``layers`` x (MatMul [+ bias Add] -> Relu) of ``hidden`` units on a
    ``rank``-D input, every weight in ``directory/{stem}.data``, one tensor in memory at a time."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    nodes, inits, x, offset = [], [], "x", 0
    with open(os.path.join(directory, f"{stem}.data"), "wb") as data:
        for i in range(layers):
            shapes = [(f"w{i}", (hidden, hidden))] + ([(f"b{i}", (hidden,))] if bias else [])
            for name, shape in shapes:
                scale = np.sqrt(2.0 / hidden) if name.startswith("w") else 0.01
                array = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
                tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
                tensor.data_location = TensorProto.EXTERNAL
                for key, value in (("location", f"{stem}.data"), ("offset", offset), ("length", array.nbytes)):
                    tensor.external_data.add(key=key, value=str(value))
                data.write(array.tobytes())
                offset += array.nbytes
                inits.append(tensor)
            nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=f"layer{i}/MatMul"))
            if bias:
                nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"], name=f"layer{i}/Add"))
            nodes.append(helper.make_node("Relu", [nodes[-1].output[0]], [f"y{i}"], name=f"layer{i}/Relu"))
            x = f"y{i}"
    shape = [1, hidden] if rank == 2 else [1, 1, hidden]
    graph = helper.make_graph(nodes, f"{stem}_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = os.path.join(directory, f"{stem}.onnx")
    onnx.save(model, path)
    return path


_ORT = """
import sys, onnx
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
q = MatMulNBitsQuantizer(sys.argv[1], bits=4, block_size=32)
q.process()
q.model.save_model_to_file(sys.argv[2], use_external_data_format=True)
"""


def measure(argv: list[str], quiet: bool = False) -> tuple[float, float, int]:
    """``(wall_s, peak_rss_gb, returncode)`` of ``python argv...`` in a child process (output dropped if ``quiet``)."""
    start = time.perf_counter()
    quiet_to = subprocess.DEVNULL if quiet else None
    child = subprocess.Popen([sys.executable, *argv], stdout=quiet_to, stderr=quiet_to)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    return wall, usage.ru_maxrss / 2**20, os.waitstatus_to_exitcode(status)


def _size_gb(directory: str, prefix: str) -> float:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.startswith(prefix)) / 1e9


def _check(directory: str, hidden: int) -> tuple[int, float]:
    """MatMulNBits in ORT's optimized graph of kenosis' output, and its output cosine against FP32."""
    import onnxruntime as ort  # noqa: PLC0415

    options = ort.SessionOptions()
    options.optimized_model_filepath = os.path.join(directory, "optimized.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    feed = {"x": np.random.default_rng(1).standard_normal((1, 1, hidden), dtype=np.float32)}
    quantized = ort.InferenceSession(os.path.join(directory, "kenosis_rtn.onnx"), options)
    got = quantized.run(None, feed)[0].ravel()
    del quantized
    optimized = onnx.load(options.optimized_model_filepath, load_external_data=False)
    fused = sum(node.op_type == "MatMulNBits" for node in optimized.graph.node)
    expected = ort.InferenceSession(os.path.join(directory, "big.onnx")).run(None, feed)[0].ravel()
    cosine = float(got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected) + 1e-30))
    return fused, cosine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="where the big files go (deleted afterwards unless --keep)")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    d = args.directory
    path = build(d, args.layers, args.hidden)
    model_gb = _size_gb(d, "big.")
    cli = ["-m", "kenosis_rewrite"]
    steps = {
        "onnxruntime MatMulNBitsQuantizer (asymmetric RTN)": (
            ["-c", _ORT, path, os.path.join(d, "ort.onnx")], "ort."),
        "kenosis quantize-weights --rtn (symmetric RTN)": (
            [*cli, "quantize-weights", path, os.path.join(d, "kenosis_rtn.onnx"), "--rtn"], "kenosis_rtn."),
        "kenosis quantize-weights --rtn --asymmetric (ORT's algorithm)": (
            [*cli, "quantize-weights", path, os.path.join(d, "kenosis_asym.onnx"), "--rtn", "--asymmetric"],
            "kenosis_asym."),
        "kenosis quantize-weights (default: per-block scale search)": (
            [*cli, "quantize-weights", path, os.path.join(d, "kenosis.onnx")], "kenosis."),
        "kenosis fix on the --rtn output (QDQ form)": (
            [*cli, "fix", os.path.join(d, "kenosis_rtn.onnx"), os.path.join(d, "fixed.onnx")], "fixed."),
        "kenosis fix on ORT's output (MatMulNBits form)": (
            [*cli, "fix", os.path.join(d, "ort.onnx"), os.path.join(d, "fixed_ort.onnx")], "fixed_ort."),
        "kenosis explain on the FP32 model (ORT session on the path)": (
            [*cli, "explain", path], None),
        "kenosis explain on the --rtn output": ([*cli, "explain", os.path.join(d, "kenosis_rtn.onnx")], None),
    }
    print(f"model: {args.layers} x MatMul[{args.hidden}x{args.hidden}] FP32, {model_gb:.2f} GB (external data)\n")
    print("| step | wall s | peak RSS GB | output GB | exit |")
    print("|---|---|---|---|---|")
    for name, (argv, prefix) in steps.items():
        wall, rss, code = measure(argv, quiet=argv[0] == "-c" or prefix is None)
        output = f"{_size_gb(d, prefix):.2f}" if prefix else "-"
        print(f"| {name} | {wall:.1f} | {rss:.2f} | {output} | {code} |", flush=True)
    fused, cosine = _check(d, args.hidden)
    print(f"\nORT fuses {fused} of {args.layers} MatMuls of kenosis' --rtn output into MatMulNBits; "
          f"output cosine vs FP32 {cosine:.5f}")
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
