"""A model over 2 GB (weights in an external data file): quantize_weights() from its path, then save().

    python examples/large_model.py DIR                            # 40 x MatMul[4096x4096] FP32: 2.7 GB
    python examples/large_model.py DIR --layers 2 --hidden 256    # the same steps in a second
    python examples/large_model.py DIR --model BIG.onnx           # your own model (its data files beside it)

A protobuf cannot hold 2 GB, so such a model lives as ``big.onnx`` plus ``big.data``. Given the
path, ``quantize_weights`` reads the weights memory-mapped, one at a time, and returns an
``onnx_ir.Model`` when the result is still over 2 GB; ``kenosis_rewrite.save`` writes any result
with its tensors in ``<name>.data``. ``fix()`` and ``explain()`` take such paths the same way. Without
``--model`` this builds an MLP of ``--layers`` blocks ``MatMul -> Add -> Relu`` on ``x[1, 1, hidden]``
(a decoder's activations, one token), writing one weight at a time. It prints wall time and peak
memory of the quantization, the sizes, and the output's cosine against FP32 in ONNX Runtime.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

import kenosis_rewrite


def build(directory: str, layers: int, hidden: int, seed: int = 0) -> str:
    """``directory/big.onnx`` with every weight in ``directory/big.data``, one tensor in memory at a time."""
    rng = np.random.default_rng(seed)
    nodes, tensors, x, offset = [], [], "x", 0
    with open(os.path.join(directory, "big.data"), "wb") as data:
        for i in range(layers):
            for name, shape, scale in ((f"w{i}", (hidden, hidden), np.sqrt(2 / hidden)), (f"b{i}", (hidden,), 0.01)):
                array = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
                tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
                tensor.data_location = TensorProto.EXTERNAL
                for key, value in (("location", "big.data"), ("offset", offset), ("length", array.nbytes)):
                    tensor.external_data.add(key=key, value=str(value))
                data.write(array.tobytes())
                offset += array.nbytes
                tensors.append(tensor)
            nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"]),
                      helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"]),
                      helper.make_node("Relu", [f"add{i}"], [f"y{i}"])]
            x = f"y{i}"
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 1, hidden]) for name in ("x", x)]
    model = helper.make_model(helper.make_graph(nodes, "big_mlp", io[:1], io[1:], tensors),
                              opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    path = os.path.join(directory, "big.onnx")
    onnx.save(model, path)
    return path


def megabytes(path: str) -> float:
    """Size of ``path`` and of the data files beside it that share its name."""
    folder, stem = os.path.dirname(path), os.path.splitext(os.path.basename(path))[0]
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.startswith(stem + ".")) / 1e6


def outputs(path: str, feed: dict) -> np.ndarray:
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])  # a path: ORT reads the data files
    return session.run(None, feed)[0].ravel().astype(np.float64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where the files go (those made here are deleted at the end unless --keep)")
    parser.add_argument("--model", help="quantize this FP32 model instead of building one")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args(argv)
    os.makedirs(args.directory, exist_ok=True)
    source = args.model or build(args.directory, args.layers, args.hidden)
    target = os.path.join(args.directory, "int4.onnx")

    start = time.perf_counter()
    quantized = kenosis_rewrite.quantize_weights(source, bits=4, block_size=32)
    kenosis_rewrite.save(quantized, target, external_data=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"quantize_weights + save: {seconds:.1f} s, peak memory of this process {peak:.2f} GB")
    print(f"FP32 {megabytes(source):.1f} MB -> int4 {megabytes(target):.1f} MB ({target} and its .data)")
    print(kenosis_rewrite.explain(target).summary().splitlines()[0])

    inputs = onnx.load(source, load_external_data=False).graph.input
    first = inputs[0]
    if len(inputs) == 1 and first.type.tensor_type.elem_type == TensorProto.FLOAT:  # else feed it your own data
        shape = [d.dim_value or 1 for d in first.type.tensor_type.shape.dim]
        feed = {first.name: np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
        expected, got = outputs(source, feed), outputs(target, feed)
        print(f"output cosine vs FP32: {expected @ got / (np.linalg.norm(expected) * np.linalg.norm(got)):.5f}")
    if not args.keep:  # only the files made here
        made = [target, target + ".data"] + ([] if args.model else [source, os.path.join(args.directory, "big.data")])
        for path in made:
            if os.path.exists(path):
                os.remove(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
