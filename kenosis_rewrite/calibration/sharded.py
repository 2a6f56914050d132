"""Calibration over many samples in shards (processes, or Ray tasks), merged exactly.

A :class:`~kenosis_rewrite.calibration.histogram.StreamingHistogram` grows its bins as samples come,
so two histograms of two halves of the samples have different bins and do not sum. Two passes make
them sum: the first measures each tensor's min and max on every shard (merged exactly: the min of
the mins, the max of the maxes); the second bins every shard's values over those extremes
(:meth:`StreamingHistogram.cover`), where no bin ever regrows, so the shards' counts add up to the
counts of one pass over all the samples, bit for bit, and every range method reads the same
histogram. ``method="minmax"`` needs the first pass only.

The result equals :func:`collect_ranges_sharded` with one shard, whatever the split and the engine
(tested). It is not the single-pass :func:`~kenosis_rewrite.calibration.collect.collect_ranges`: that
one's bins depend on the order the samples came in. ``engine="ray"`` runs each shard as a Ray task
(the ``ray`` extra; ``ray.init()`` is the caller's, or a local instance), which pays where the
samples are many and the cluster has more cores than the model's runs use (see
``docs/benchmarks/sharded_calibration/``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

from kenosis_rewrite.calibration.collect import TensorRanges, collect_histograms, model_hash
from kenosis_rewrite.calibration.histogram import METHODS, StreamingHistogram, range_from_histogram
from kenosis_rewrite.errors import CalibrationError, KenosisError

__all__ = ["collect_ranges_sharded", "shard_extremes", "shard_histograms"]

Feeds = Sequence[Mapping[str, np.ndarray]]


def shard_extremes(model: bytes, feeds: Feeds) -> tuple[dict[str, tuple[float, float]], int]:
    """Each calibrated tensor's ``(min, max)`` over ``feeds`` (one shard), and the number of samples."""
    histograms, samples = collect_histograms(onnx.load_from_string(model), list(feeds), histogram=False)
    return {name: (float(h.minimum), float(h.maximum)) for name, h in histograms.items() if h.count}, samples


def shard_histograms(model: bytes, feeds: Feeds, extremes: Mapping[str, tuple[float, float]],
                     bins: int) -> dict[str, StreamingHistogram]:
    """Histograms of one shard, each tensor's bins covering its extremes over every shard."""
    histograms, _ = collect_histograms(onnx.load_from_string(model), list(feeds), bins=bins, anchors=extremes)
    return histograms


def _merged_extremes(parts: list[tuple[dict, int]]) -> tuple[dict[str, tuple[float, float]], int]:
    extremes: dict[str, tuple[float, float]] = {}
    for found, _ in parts:
        for name, (low, high) in found.items():
            old = extremes.get(name, (low, high))
            extremes[name] = (min(low, old[0]), max(high, old[1]))
    return extremes, sum(samples for _, samples in parts)


def _merged_histograms(parts: list[dict[str, StreamingHistogram]]) -> dict[str, StreamingHistogram]:
    merged: dict[str, StreamingHistogram] = {}
    for part in parts:
        for name, histogram in part.items():
            if name not in merged:
                merged[name] = StreamingHistogram(histogram.bins, count_zeros=histogram.counts_zeros)
            merged[name].merge(histogram)
    return merged


def _mapper(engine: str) -> Callable:
    """``map(function, argument tuples) -> results`` for ``engine``."""
    if engine == "local":
        return lambda function, calls: [function(*call) for call in calls]
    if engine != "ray":
        raise KenosisError(f"engine must be 'local' or 'ray', got {engine!r}")
    try:
        import ray  # noqa: PLC0415 - the optional extra
    except ImportError as error:
        raise KenosisError('engine="ray" needs Ray: pip install "kenosis-rewrite[ray]"') from error

    def on_ray(function, calls):
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        remote = ray.remote(num_cpus=1)(function)
        return ray.get([remote.remote(*call) for call in calls])

    return on_ray


def collect_ranges_sharded(float_model: onnx.ModelProto, shards: Sequence[Feeds], method: str = "minmax",
                           percentile: float = 99.99, *, bins: int = 8192, engine: str = "local") -> TensorRanges:
    """Per-tensor ranges of ``float_model`` over the samples of every shard (see the module docstring)."""
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; known: {METHODS}")
    shards = [list(shard) for shard in shards if len(shard)]
    if not shards:
        raise CalibrationError("no calibration samples: every shard is empty")
    run = _mapper(engine)
    model = float_model.SerializeToString()
    extremes, samples = _merged_extremes(run(shard_extremes, [(model, shard) for shard in shards]))
    if method == "minmax":
        ranges = dict(extremes)
    else:
        histograms = _merged_histograms(run(shard_histograms, [(model, shard, extremes, bins) for shard in shards]))
        ranges = {name: range_from_histogram(h, method, percentile) for name, h in histograms.items()}
    return TensorRanges(ranges, method, percentile if method == "percentile" else None, samples, model_hash(float_model))
