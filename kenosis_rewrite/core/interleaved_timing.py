"""Latency measurement done right: one thread, warm-up, interleaved turns of steady-state runs, medians."""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from kenosis_rewrite.core import ort_sessions
from kenosis_rewrite.errors import RuntimeMeasurementError

TURN_SECONDS = 0.2  # timed runs per turn: long enough that session switches are rare
SETTLE_SECONDS = 0.03  # untimed runs after each switch, until the caches hold this model again
MIN_RUNS_PER_TURN = 3


def _cpu_info() -> tuple[str, frozenset[str]]:
    name, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return name, flags


def cpu_description() -> str:
    """CPU model and the instruction sets ORT's integer kernels pick from, e.g. 'Xeon (avx512_vnni, amx_int8)'."""
    name, flags = _cpu_info()
    isa = [flag for flag in ("avx2", "avx512f", "avx_vnni", "avx512_vnni", "amx_int8") if flag in flags]
    return f"{name} ({', '.join(isa)})" if isa else name


def u8s8_saturates() -> bool:
    """Whether ORT's uint8 x int8 kernels on this host add product pairs in int16 with saturation.

    x86 without VNNI (AVX2 or AVX-512 alone) multiplies with VPMADDUBSW: two products of up to
    255 x 127 each overflow int16 (onnxruntime's quantization docs: use reduce_range or u8u8 there).
    Measured here on an AVX2-only AMD EPYC: integer Convs with full-range per-channel weights lose up
    to 0.007 cosine that the same graph in float does not.
    """
    _, flags = _cpu_info()
    return "avx2" in flags and not flags & {"avx_vnni", "avx512_vnni", "amx_int8"}


def session(model_bytes: bytes, threads: int = 1) -> ort.InferenceSession:
    """A timing session (``threads`` intra-op threads, all optimisations); refusal is a RuntimeMeasurementError."""
    try:
        return ort_sessions.session(model_bytes, ort_sessions.options(threads))
    except Exception as error:  # noqa: BLE001 - ORT raises several unrelated exception types
        raise RuntimeMeasurementError(f"ONNX Runtime could not build a session: {error}") from None


@dataclasses.dataclass(frozen=True)
class Turn:
    """One variant's turn in an interleaved measurement: ``settle`` untimed runs, then ``timed`` runs."""

    name: str
    settle: int
    timed: int


def turn_plan(
    per_run_seconds: Mapping[str, float],
    runs: Mapping[str, int],
    *,
    turn_seconds: float = TURN_SECONDS,
    settle_seconds: float = SETTLE_SECONDS,
) -> list[Turn]:
    """Round-robin turns giving each variant its ``runs`` timed runs, order reversed every other round.

    Switching sessions leaves the caches full of the other model: the first runs of a turn are up
    to 15% slower and take ~20 ms to settle (measured on PP-LCNet, 2.8 ms per run), so every turn
    starts with untimed runs filling ``settle_seconds`` (at least one), and lasts ``turn_seconds``
    of timed runs (at least ``MIN_RUNS_PER_TURN``): medians of steady-state runs, while drift slower
    than a round still hits every variant alike.
    """
    names = list(per_run_seconds)
    left = {name: int(runs[name]) for name in names}
    per_turn = {name: max(MIN_RUNS_PER_TURN, math.ceil(turn_seconds / max(per_run_seconds[name], 1e-9))) for name in names}
    settle = {name: max(1, math.ceil(settle_seconds / max(per_run_seconds[name], 1e-9))) for name in names}
    plan: list[Turn] = []
    round_index = 0
    while any(left.values()):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            if left[name]:
                timed = min(per_turn[name], left[name])
                plan.append(Turn(name, settle[name] if len(names) > 1 else 0, timed))
                left[name] -= timed
        round_index += 1
    return plan


def interleaved_samples(
    sessions: Mapping[str, ort.InferenceSession],
    feed: Mapping[str, np.ndarray],
    *,
    warmup: int = 20,
    runs: int = 100,
    min_seconds: float = 0.0,
    turn_seconds: float = TURN_SECONDS,
    settle_seconds: float = SETTLE_SECONDS,
) -> dict[str, list[float]]:
    """Seconds per timed run of each session: ``warmup`` runs each, then interleaved turns (:func:`turn_plan`).

    Each variant gets at least ``runs`` timed runs, and more when needed to spend ``min_seconds``
    on it (sub-millisecond models need thousands of runs for a stable median).
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    feed = dict(feed)
    per_run: dict[str, float] = {}
    for name, session in sessions.items():
        times = []
        for _ in range(max(1, warmup)):
            start = time.perf_counter()
            try:
                session.run(None, feed)
            except Exception as error:  # noqa: BLE001 - ORT raises several unrelated exception types
                raise RuntimeMeasurementError(f"ONNX Runtime failed to run variant {name!r}: {error}") from None
            times.append(time.perf_counter() - start)
        per_run[name] = float(np.median(times))
    wanted = {name: max(runs, math.ceil(min_seconds / per_run[name])) if min_seconds > 0 else runs for name in sessions}
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    for turn in turn_plan(per_run, wanted, turn_seconds=turn_seconds, settle_seconds=settle_seconds):
        run = sessions[turn.name].run
        for _ in range(turn.settle):
            run(None, feed)
        for _ in range(turn.timed):
            start = time.perf_counter()
            run(None, feed)
            samples[turn.name].append(time.perf_counter() - start)
    return samples


def interleaved_medians(
    sessions: Mapping[str, ort.InferenceSession],
    feed: Mapping[str, np.ndarray],
    *,
    warmup: int = 3,
    seconds: float = 0.5,
    runs: int = 20,
) -> dict[str, float]:
    """Median seconds per run of each session: at least ``runs`` runs and ``seconds`` each, interleaved."""
    samples = interleaved_samples(sessions, feed, warmup=warmup, runs=runs, min_seconds=seconds,
                                  turn_seconds=min(TURN_SECONDS, seconds / 3))
    return {name: float(np.median(values)) for name, values in samples.items()}
