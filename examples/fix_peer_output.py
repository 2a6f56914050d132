"""fix() another quantizer's QDQ output (NNCF, Quark, INC, ModelOpt, quantize_static): integer kernels, fidelity.

    python examples/fix_peer_output.py        # the NNCF 3.4 output of a YOLOv8 C2f-style toy, in tests/fixtures
    python examples/fix_peer_output.py PEER.onnx --float-model FP32.onnx --feeds FEEDS.npz --output fixed.onnx

fix() needs nothing but the quantized model. Given the FP32 original and calibration feeds it also
reports fidelity against FP32 (and with ``--bias-correction`` moves each layer's mean output shift
into its int32 bias). ``FEEDS.npz`` holds one array per model input, named as the input, the
samples stacked on a new first axis: ``np.savez("feeds.npz", x=np.stack(list_of_x_arrays))``. Without
it, random normal feeds stand in (what the fixtures were calibrated on; use real data for yours).
The first half of the feeds is given to fix(), the other half measures the cosine below.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import onnx
import onnxruntime as ort

import kenosis_rewrite

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
DEFAULT_PEER, DEFAULT_FLOAT = str(FIXTURES / "c2fish_nncf3.4.onnx"), str(FIXTURES / "c2fish_fp32.onnx")


def load_feeds(path: str | None, model: onnx.ModelProto, count: int = 12) -> list[dict[str, np.ndarray]]:
    """Feeds from ``path`` (see the docstring), else ``count`` random normal ones (symbolic dims = 1)."""
    if path is not None:
        data = np.load(path)
        return [{name: data[name][i] for name in data.files} for i in range(len(data[data.files[0]]))]
    rng = np.random.default_rng(1)
    inputs = [(i.name, onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type),
               [d.dim_value or 1 for d in i.type.tensor_type.shape.dim]) for i in model.graph.input]
    return [{name: rng.standard_normal(shape).astype(dtype) for name, dtype, shape in inputs} for _ in range(count)]


def worst_cosine(reference: onnx.ModelProto, candidate: onnx.ModelProto, feeds) -> float:
    """The worst output's cosine against ``reference`` over all ``feeds``."""
    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            for m in (reference, candidate)]
    outputs = [[run.run(None, feed) for feed in feeds] for run in runs]
    cosines = []
    for i in range(len(outputs[0][0])):
        a, b = (np.concatenate([np.ravel(o[i]) for o in side]).astype(np.float64) for side in outputs)
        cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)))
    return min(cosines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", nargs="?", default=DEFAULT_PEER, help="the quantized model")
    parser.add_argument("--float-model", help="its FP32 original (default: the fixture's, for the default PEER)")
    parser.add_argument("--feeds", help="calibration / evaluation feeds, .npz (default: random normal)")
    parser.add_argument("--bias-correction", action="store_true", help="correct int32 biases against FP32")
    parser.add_argument("--output", help="where to save the fixed model")
    args = parser.parse_args(argv)
    float_path = args.float_model or (DEFAULT_FLOAT if args.peer == DEFAULT_PEER else None)

    peer = onnx.load(args.peer)
    float_model = onnx.load(float_path) if float_path else None
    feeds = load_feeds(args.feeds, float_model or peer)
    calibration, held_out = feeds[: len(feeds) // 2], feeds[len(feeds) // 2:]
    fixed, report = kenosis_rewrite.fix(peer, float_model=float_model, calibration=calibration,
                                        bias_correction=args.bias_correction and float_model is not None,
                                        return_report=True)
    print(report.summary())
    print("\nbefore fix():", kenosis_rewrite.explain(peer).summary().splitlines()[0])
    print("after fix(): ", kenosis_rewrite.explain(fixed).summary().splitlines()[0])
    if float_model is not None and held_out:
        before, after = (worst_cosine(float_model, m, held_out) for m in (peer, fixed))
        print(f"cosine vs FP32 on {len(held_out)} held-out feeds: {before:.5f} before fix(), {after:.5f} after")
    if args.output:
        kenosis_rewrite.save(fixed, args.output)
        print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
