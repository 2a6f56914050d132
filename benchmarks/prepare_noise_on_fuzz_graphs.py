"""Does canonicalization (prepare()) change how well quantize_static quantizes? Measured on the fuzz's
random graphs.

For each seed: the fuzz's random FP32 graph and its 4 calibration / 4 evaluation feeds; plain
quantize_static (uint8 activations, int8 per-channel weights) of the graph as generated and of
``prepare()``'s canonical graph; the noise of each is ``1 - cosine`` against FP32 on the evaluation
feeds (the worst output). Prints the mean and median change of that noise in dB (negative: the
canonical graph quantizes better) and how many seeds moved by more than 1 dB either way.

    python benchmarks/prepare_noise_on_fuzz_graphs.py 3700000 300
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

import kenosis_rewrite
from kenosis_rewrite.testing import fuzz_properties
from kenosis_rewrite.testing.fuzz_configs import plain_quant_config, quantize_or_skip
from kenosis_rewrite.testing.fuzz_models import N_CALIBRATION, random_float_model
from kenosis_rewrite.testing.fuzz_running import min_cosine, run_model


def noise_change_db(seed: int) -> float | None:
    """10 log10 of (noise of the canonical graph quantized / noise of the graph as generated)."""
    fp32, feeds = random_float_model(np.random.default_rng(seed), softmax_head=seed >= fuzz_properties.SOFTMAX_HEAD_SEEDS)
    calibration, evaluation = feeds[:N_CALIBRATION], feeds[N_CALIBRATION:]
    _, reference = run_model(fp32.SerializeToString(), evaluation, "disable_all")
    noise = []
    for model in (fp32, kenosis_rewrite.prepare(fp32, calibration)):
        quantized, _ = quantize_or_skip(model, plain_quant_config(), calibration)
        if quantized is None:
            return None
        cosine = min_cosine(reference, run_model(quantized.SerializeToString(), evaluation, "disable_all")[1])
        if not np.isfinite(cosine):
            return None
        noise.append(max(1.0 - cosine, 1e-7))
    return 10 * np.log10(noise[1] / noise[0])


def main() -> None:
    start, count = int(sys.argv[1]), int(sys.argv[2])
    warnings.filterwarnings("ignore")
    changes = []
    for seed in range(start, start + count):
        try:
            change = noise_change_db(seed)
        except kenosis_rewrite.KenosisError:
            continue
        if change is not None:
            changes.append(change)
    values = np.array(changes)
    print(f"{len(values)} graphs: noise change, canonical vs as generated: mean {values.mean():+.3f} dB, "
          f"median {np.median(values):+.3f} dB; worse by > 1 dB: {int((values > 1).sum())}, "
          f"better by > 1 dB: {int((values < -1).sum())}")


if __name__ == "__main__":
    main()
