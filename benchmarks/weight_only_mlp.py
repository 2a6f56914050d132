"""Benchmark: ``quantize_weights()`` of a 2.7 GB MLP against onnxruntime's ``MatMulNBitsQuantizer`` (issue 52 item 5).

    python benchmarks/weight_only_mlp.py DIR [--layers 40] [--hidden 4096] [--rank 2] [--bias]
        [--repeat 1] [--json docs/benchmarks/weight_only_mlp/mlp_2d_relu.json] [--keep]

Builds ``DIR/mlp.onnx``: ``--layers`` blocks ``MatMul(W[h, h]) (-> Add(bias)) -> Relu`` on ``x[1, h]``
(``--rank 3``: ``x[1, 1, h]``), FP32 weights in the external file ``DIR/mlp.data`` (40 x 4096 x 4096:
2.7 GB), written one weight at a time. Each step then runs in its own Python process (wall time
around the child, peak RSS from ``os.wait4``'s rusage), load and save included:

* onnxruntime's ``MatMulNBitsQuantizer``: 4 bits, block 32, symmetric round-to-nearest;
* ``kenosis_rewrite.quantize_weights(path, bits=4)``: block 32, symmetric, per-block scale search
  (its default), saved with :func:`kenosis_rewrite.save`;
* the same with ``scale_search=False`` (plain absmax round-to-nearest: ORT's algorithm).

``--repeat N`` runs the three steps N times, interleaved, and keeps each one's median. Each output
is then loaded in ORT with its optimized graph written out: the MatMulNBits it runs, and its output
cosine against the FP32 model on one random input. ``--json`` writes the record
``docs/benchmarks/weight_only_mlp/`` keeps (``tools/gen_docs.py`` renders it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from large_model import _size_gb, build, measure  # noqa: E402 - one model writer, one child-process measure

_ORT = """
import sys
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
q = MatMulNBitsQuantizer(sys.argv[1], bits=4, block_size=32, is_symmetric=True)
q.process()
q.model.save_model_to_file(sys.argv[2], use_external_data_format=True)
"""

_KENOSIS = """
import sys, kenosis_rewrite
out = kenosis_rewrite.quantize_weights(sys.argv[1], bits=4, block_size=32, scale_search=sys.argv[3] == "search")
kenosis_rewrite.save(out, sys.argv[2])
"""


def _measure(argv: list[str]) -> tuple[float, float]:
    """``(wall_s, peak_rss_gb)`` of ``python argv...`` in a child process (output dropped); raises if it fails."""
    wall, rss, code = measure(argv, quiet=True)
    if code:
        raise RuntimeError(f"step failed with exit code {code}: {argv[2:]}")
    return wall, rss


def check(directory: str, name: str, fp32_output: np.ndarray, feed: dict) -> tuple[int, int, float]:
    """``(MatMulNBits, MatMul)`` in ORT's optimized graph of ``name``.onnx, and its output cosine against FP32."""
    import onnxruntime as ort  # noqa: PLC0415

    options = ort.SessionOptions()
    options.optimized_model_filepath = os.path.join(directory, f"{name}_optimized.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                     f"{name}_optimized.data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    session = ort.InferenceSession(os.path.join(directory, f"{name}.onnx"), options)
    got = session.run(None, feed)[0].ravel()
    del session
    optimized = onnx.load(options.optimized_model_filepath, load_external_data=False)
    ops = [node.op_type for node in optimized.graph.node]
    for suffix in (".onnx", ".data"):
        os.remove(os.path.join(directory, f"{name}_optimized{suffix}"))
    cosine = float(got @ fp32_output / (np.linalg.norm(got) * np.linalg.norm(fp32_output) + 1e-30))
    return ops.count("MatMulNBits"), ops.count("MatMul"), cosine


def _fp32_output(path: str, feed: dict) -> np.ndarray:
    import onnxruntime as ort  # noqa: PLC0415

    return ort.InferenceSession(path).run(None, feed)[0].ravel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="where the big files go (deleted afterwards unless --keep)")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rank", type=int, choices=(2, 3), default=2)
    parser.add_argument("--bias", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", help="write the record here")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    d = args.directory
    path = build(d, args.layers, args.hidden, bias=args.bias, rank=args.rank, stem="mlp")
    steps = {
        "onnxruntime MatMulNBitsQuantizer (symmetric RTN)": ("ort", ["-c", _ORT, path, os.path.join(d, "ort.onnx")]),
        "kenosis quantize_weights (default: scale search)": (
            "kenosis", ["-c", _KENOSIS, path, os.path.join(d, "kenosis.onnx"), "search"]),
        "kenosis quantize_weights(scale_search=False) (symmetric RTN)": (
            "kenosis_rtn", ["-c", _KENOSIS, path, os.path.join(d, "kenosis_rtn.onnx"), "rtn"]),
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(args.repeat):
        for name, (prefix, argv) in steps.items():
            for stale in (f for f in os.listdir(d) if f.startswith(prefix + ".")):  # ORT appends to its .data
                os.remove(os.path.join(d, stale))
            runs[name].append(_measure(argv))
    feed_shape = (1, args.hidden) if args.rank == 2 else (1, 1, args.hidden)
    feed = {"x": np.random.default_rng(1).standard_normal(feed_shape, dtype=np.float32)}
    expected = _fp32_output(path, feed)
    ort_wall = statistics.median(wall for wall, _ in runs[next(iter(steps))])
    ort_rss = statistics.median(rss for _, rss in runs[next(iter(steps))])
    variants = {}
    for name, (prefix, _) in steps.items():
        fused, matmuls, cosine = check(d, prefix, expected, feed)
        wall = statistics.median(w for w, _ in runs[name])
        rss = statistics.median(r for _, r in runs[name])
        variants[name] = {"wall_s": wall, "wall_vs_ort": wall / ort_wall, "peak_rss_gb": rss,
                          "peak_rss_vs_ort": rss / ort_rss, "output_gb": _size_gb(d, prefix + "."),
                          "matmulnbits_in_ort": fused, "float_matmul_in_ort": matmuls, "cosine_vs_fp32": cosine}
    activations = f"x[{', '.join(str(v) for v in feed_shape)}]"
    model = f"{args.layers} x MatMul[{args.hidden}x{args.hidden}]{' + Add' if args.bias else ''} -> Relu, {activations}"
    print(f"model: {model}, FP32 {_size_gb(d, 'mlp.'):.2f} GB (external data); median of {args.repeat}\n")
    print("| step | wall s | x ORT | peak RSS GB | x ORT | output GB | MatMulNBits in ORT | cosine vs FP32 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, v in variants.items():
        print(f"| {name} | {v['wall_s']:.1f} | {v['wall_vs_ort']:.2f} | {v['peak_rss_gb']:.2f} | {v['peak_rss_vs_ort']:.2f} "
              f"| {v['output_gb']:.2f} | {v['matmulnbits_in_ort']} of {args.layers} | {v['cosine_vs_fp32']:.5f} |")
    if args.json:
        import onnxruntime as ort  # noqa: PLC0415

        record = {"kind": "weight_only_mlp", "model": model, "peer": f"onnxruntime MatMulNBitsQuantizer {ort.__version__}",
                  "command": "python " + shlex.join(sys.argv), "onnxruntime": ort.__version__,
                  "machine": platform.machine(), "cpu_count": os.cpu_count(), "repeat": args.repeat,
                  "variants": variants}
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)
            handle.write("\n")
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
