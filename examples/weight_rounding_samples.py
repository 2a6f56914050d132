"""Weight rounding's floor of input samples per weight, on and off, on zoo models.

Each model is quantized on 16 street/park scenes with ``weight_rounding.MIN_SAMPLES_PER_COLUMN`` at
its default (2) and at 0 (every small fan-in layer re-rounded, however few inputs it saw); prints
how many layers the floor left at round-to-nearest and the mean output cosine against FP32 on the
100 held-out object photos (ORT, all optimizations on).

    python examples/weight_rounding_samples.py ppocr_mobile_v2_cls,ppocr_v3_det,ppocr_v4_det
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.accuracy import weight_rounding
from kenosis_rewrite import zoo
from kenosis_rewrite.testing.fuzz_running import run_model


def mean_cosine(reference, outputs) -> float:
    return float(np.mean([fidelity.cosine(np.concatenate([np.ravel(o[i]) for o in reference]),
                                          np.concatenate([np.ravel(o[i]) for o in outputs]))
                          for i in range(len(reference[0]))]))


def main() -> None:
    warnings.filterwarnings("ignore")
    scenes, objects = zoo.load_photo_set("scenes", 16), zoo.load_photo_set("objects")
    default = weight_rounding.MIN_SAMPLES_PER_COLUMN
    for name in sys.argv[1].split(","):
        model = zoo.load_model(name)
        calibration, evaluation = zoo.model_feeds(name, scenes), zoo.model_feeds(name, objects)
        _, reference = run_model(model.SerializeToString(), evaluation, "enable_all")
        row = [name]
        for floor in (default, 0):
            weight_rounding.MIN_SAMPLES_PER_COLUMN = floor
            quantized, report = kenosis_rewrite.quantize(model, calibration=calibration, return_report=True)
            kept = sum(1 for r in report.refusals if r.rule == weight_rounding.RULE_NAME and "input samples" in r.reason)
            _, outputs = run_model(quantized.SerializeToString(), evaluation, "enable_all")
            row.append(f"floor {floor}: {kept} layers kept round-to-nearest, cosine {mean_cosine(reference, outputs):.5f}")
        weight_rounding.MIN_SAMPLES_PER_COLUMN = default
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
