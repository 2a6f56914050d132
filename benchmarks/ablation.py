"""Ablation of one quantize() option: fidelity against FP32 with it off and on, on real models and photos.

    python benchmarks/ablation.py OPTION [MODEL,MODEL,...] [--photos large|default]

``OPTION`` is a boolean keyword of :func:`kenosis_rewrite.quantize` (``share_concat_ranges``,
``bias_correction``, ...). ``--photos large`` (default): both variants calibrate on the same 16
street/park scenes and are scored on 100 held-out photos of objects (``zoo.PHOTO_SETS``);
``--photos default``: the zoo's 12 photos, the first 8 calibrate, the last 4 score. ORT CPU, default
graph optimizations (integer kernels), one thread; cosine of the worst output, top-1 = arg-max
agreement with FP32 where the model is a classifier.
"""

from __future__ import annotations

import argparse

from kenosis_rewrite import quantize, zoo
from kenosis_rewrite.benchmark import bench
from kenosis_rewrite.core import fidelity

DEFAULT_MODELS = "nudenet_yolov8n,ddddocr_det,layout_cdla,mobilenet_v2"


def feeds(name: str, photos: str, calibration_samples: int = 16) -> tuple[list, list]:
    """(calibration, evaluation) feeds of zoo model ``name``."""
    if photos == "large":
        scenes = zoo.load_photo_set("scenes", calibration_samples)
        return zoo.model_feeds(name, scenes), zoo.model_feeds(name, zoo.load_photo_set("objects"))
    every = zoo.model_feeds(name, zoo.load_photos())
    return every[:8], every[8:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("option", help="a boolean keyword of quantize()")
    parser.add_argument("models", nargs="?", default=DEFAULT_MODELS)
    parser.add_argument("--photos", choices=("large", "default"), default="large")
    args = parser.parse_args()
    for name in args.models.split(","):
        model, entry = zoo.load_model(name), zoo.get_model(name)
        calibration, evaluation = feeds(name, args.photos)
        reference = fidelity.run(model, evaluation)
        for on in (False, True):
            variant = quantize(model, calibration, **{args.option: on})
            scores = bench.fidelity(reference, fidelity.run(variant, evaluation), entry.class_output)
            top1 = "" if scores.top1_agreement is None else f" top-1 {scores.top1_agreement:.0%}"
            print(f"{name:20s} {args.option}={on!s:5s}: cosine {scores.cosine:.5f}{top1}", flush=True)


if __name__ == "__main__":
    main()
