"""Bias correction measured from input means against measured by quantized copies, on zoo models.

Each model is quantized on 16 street/park scenes twice per round, alternating: as by default (Gemms
and Convs with at least ``bias_correction.MIN_TAPPED_OUTPUTS`` products per input value measured
from the means, per kernel tap, of their input and its quantization error) and with every Conv
measured by a quantized copy of it (the code before). Prints the median seconds spent in bias correction
over the rounds, the int32 bias values that differ between the two models, and the mean output
cosine against FP32 on the 100 held-out object photos (ORT, all optimizations on).

    python examples/bias_correction_by_means.py efficientnet_lite0,mobilenet_v2,layout_cdla,ppocr_v4_det [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import numpy as np
from onnx import numpy_helper

import kenosis_rewrite
from kenosis_rewrite.accuracy import bias_correction
from kenosis_rewrite.core import fidelity
from kenosis_rewrite import zoo
from kenosis_rewrite.testing.fuzz_running import run_model

quantize_module = sys.modules["kenosis_rewrite.quantization.pipeline"]


def mean_cosine(reference, outputs) -> float:
    return float(np.mean([fidelity.cosine(np.concatenate([np.ravel(o[i]) for o in reference]),
                                          np.concatenate([np.ravel(o[i]) for o in outputs]))
                          for i in range(len(reference[0]))]))


def timed_quantize(model, calibration, by_means: bool):
    """quantize(), and the seconds its bias correction took."""
    spent = []
    original = quantize_module.correct_biases

    def correct(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    default = bias_correction.MIN_TAPPED_OUTPUTS
    bias_correction.MIN_TAPPED_OUTPUTS = default if by_means else 2**62
    quantize_module.correct_biases = correct
    try:
        return kenosis_rewrite.quantize(model, calibration=calibration), sum(spent)
    finally:
        quantize_module.correct_biases = original
        bias_correction.MIN_TAPPED_OUTPUTS = default


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    scenes, objects = zoo.load_photo_set("scenes", 16), zoo.load_photo_set("objects")
    print("| model | bias correction s: copies → means | int32 bias values changed | held-out cosine: copies → means |")
    print("|---|---:|---:|---:|")
    for name in args.models.split(","):
        model = zoo.load_model(name)
        calibration, evaluation = zoo.model_feeds(name, scenes), zoo.model_feeds(name, objects)
        timed_quantize(model, calibration[:2], True)  # warm-up
        seconds: dict[bool, list[float]] = {True: [], False: []}
        models = {}
        for _ in range(args.rounds):
            for by_means in (False, True):
                models[by_means], spent = timed_quantize(model, calibration, by_means)
                seconds[by_means].append(spent)
        biases = [{i.name: numpy_helper.to_array(i) for i in models[m].graph.initializer
                   if i.data_type == 6} for m in (False, True)]  # int32
        changed = sum(int(np.count_nonzero(biases[0][k] != biases[1][k])) for k in biases[0] if k in biases[1])
        total = sum(v.size for v in biases[0].values())
        _, reference = run_model(model.SerializeToString(), evaluation, "enable_all")
        cosines = [mean_cosine(reference, run_model(models[m].SerializeToString(), evaluation, "enable_all")[1])
                   for m in (False, True)]
        print(f"| {name} | {statistics.median(seconds[False]):.2f} → {statistics.median(seconds[True]):.2f} | "
              f"{changed} of {total} | {cosines[0]:.5f} → {cosines[1]:.5f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
