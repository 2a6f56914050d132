"""Latency measurement done right: one thread, warm-up, interleaved rounds, medians."""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from kenosis_rewrite.errors import RuntimeMeasurementError


def session(model_bytes: bytes, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - ORT raises several unrelated exception types
        raise RuntimeMeasurementError(f"ONNX Runtime could not build a session: {error}") from None


def interleaved_medians(
    sessions: Mapping[str, ort.InferenceSession],
    feed: Mapping[str, np.ndarray],
    *,
    rounds: int = 6,
    per_round: int = 5,
    warmup: int = 3,
) -> dict[str, float]:
    """Median seconds per run of each session, measured in alternating rounds in this process."""
    feed = dict(feed)
    names = list(sessions)
    for name in names:
        for _ in range(warmup):
            sessions[name].run(None, feed)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        for name in order:
            run = sessions[name].run
            for _ in range(per_round):
                start = time.perf_counter()
                run(None, feed)
                samples[name].append(time.perf_counter() - start)
    return {name: float(np.median(values)) for name, values in samples.items()}
