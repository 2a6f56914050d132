"""Never slower than the input: fix()'s output timed against its input, where that is cheap.

Which kernels pay is a fact of the runtime and the machine, not of the graph: ORT's integer 3-D
Conv with a large spatial kernel runs several times slower than its float one (a 1x11x11 watermark
decoder went from 2.05x to 1.09x FP32 when fix() made its last Convs integer). So after the
run-time guard has accepted a rewrite, the input and the output are timed on one feed, one thread,
interleaved (warm-up, medians), when the input runs in ``MIN_MS`` to ``MAX_MS`` (below, timing noise
outweighs any kernel choice; above, the check costs more than it is worth). An output slower than the
input by more than ``SLOWER``, in each of ``CONFIRMATIONS`` measurements, is not returned: the rules
that changed it are undone one at a time (latest first) until the result is not slower, else the
input comes back unchanged; the report says what was measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import numpy as np
import onnx

from kenosis_rewrite.core import interleaved_timing

MIN_MS, MAX_MS = 2.0, 100.0  # input latencies where a timing check is both meaningful and cheap
SLOWER = 1.15  # output median over input median beyond which the output counts as slower
_SECONDS = 0.25  # timed seconds per model in one comparison
CONFIRMATIONS = 2  # measurements that must each find the output slower


def _median_ms(samples: list[float]) -> float:
    return 1000.0 * statistics.median(samples)


def input_latency_ms(model: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> float | None:
    """The input's median latency on ``feed`` (a few runs, one thread), or None where it does not run."""
    try:
        session = interleaved_timing.session(model.SerializeToString(), 1)
        samples = interleaved_timing.interleaved_samples({"input": session}, feed, warmup=2, runs=5)
    except Exception:  # noqa: BLE001 - a model ORT cannot time is not timed
        return None
    return _median_ms(samples["input"])


def worth_timing(latency_ms: float | None) -> bool:
    return latency_ms is not None and MIN_MS <= latency_ms <= MAX_MS


def slower(before: onnx.ModelProto, after: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> str | None:
    """Why ``after`` is slower than ``before`` on ``feed`` (medians, interleaved), or None. A verdict of
    slower is measured twice, both must say so: on a busy host one measurement's noise passed
    ``SLOWER`` and made fix() of the same model differ from one run to the next."""
    try:
        sessions = {name: interleaved_timing.session(model.SerializeToString(), 1)
                    for name, model in (("input", before), ("output", after))}
        measured = []
        for _ in range(CONFIRMATIONS):
            samples = interleaved_timing.interleaved_samples(sessions, feed, warmup=3, runs=7, min_seconds=_SECONDS)
            input_ms, output_ms = _median_ms(samples["input"]), _median_ms(samples["output"])
            if output_ms <= SLOWER * input_ms:
                return None
            measured.append(f"{input_ms:.2f} -> {output_ms:.2f} ms")
    except Exception:  # noqa: BLE001 - timing is advice; the guard has already run both models
        return None
    return f"the output ran slower than the input ({'; '.join(measured)}, 1 thread, interleaved medians)"
