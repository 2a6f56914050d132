"""Calibration in shards: any split, on any engine, gives the ranges of one shard bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from kenosis_rewrite.calibration import collect_ranges
from kenosis_rewrite.calibration.histogram import StreamingHistogram
from kenosis_rewrite.calibration.sharded import collect_ranges_sharded
from kenosis_rewrite.errors import CalibrationError, KenosisError
from kenosis_rewrite.testing import toy_models


def _split(feeds: list, sizes: list[int]) -> list[list]:
    shards, start = [], 0
    for size in sizes:
        shards.append(feeds[start:start + size])
        start += size
    return shards


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy", "mse"])
@pytest.mark.parametrize("sizes", [[4, 4, 4], [1, 11]])
def test_any_split_gives_the_ranges_of_one_shard_bit_for_bit(method, sizes):
    model = toy_models.build("conv_add_relu", seed=2)
    feeds = toy_models.random_feeds(model, 12, seed=5)
    whole = collect_ranges_sharded(model, [feeds], method)
    split = collect_ranges_sharded(model, _split(feeds, sizes), method)
    assert dict(split) == dict(whole) and split.samples == whole.samples == 12
    # and the min/max of the two-pass collection is the single-pass one's, exactly
    if method == "minmax":
        assert dict(whole) == dict(collect_ranges(model, feeds, "minmax"))
    elif method == "percentile":  # as fine a histogram as the single pass's: the same range within a bin or so
        single = collect_ranges(model, feeds, method)
        for name, (lo, hi) in whole.items():
            span = max(single[name][1] - single[name][0], 1e-6)
            assert abs(lo - single[name][0]) <= span / 1000 and abs(hi - single[name][1]) <= span / 1000


def test_covered_histograms_merge_exactly_and_different_bins_refuse():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(1000).astype(np.float32) * scale for scale in (1.0, 3.0, 0.2)]
    low, high = min(p.min() for p in parts), max(p.max() for p in parts)
    whole = StreamingHistogram(256)
    whole.cover(low, high)
    merged = StreamingHistogram(256)
    for part in parts:
        whole.update(part)
        one = StreamingHistogram(256)
        one.cover(low, high)
        one.update(part)
        merged.merge(one)
    assert np.array_equal(merged.counts, whole.counts) and merged.count == whole.count == 3000
    assert (merged.minimum, merged.maximum, merged.zeros) == (whole.minimum, whole.maximum, whole.zeros)
    stray = StreamingHistogram(256)
    stray.update(parts[0])
    with pytest.raises(ValueError, match="different bins"):
        merged.merge(stray)
    with pytest.raises(ValueError, match="before the first sample"):
        stray.cover(low, high)


def test_bad_arguments_are_typed_errors():
    model = toy_models.build("conv_relu")
    with pytest.raises(CalibrationError):
        collect_ranges_sharded(model, [[], []])
    with pytest.raises(KenosisError, match="engine"):
        collect_ranges_sharded(model, [toy_models.random_feeds(model, 2)], engine="spark")


def test_shards_as_ray_tasks_give_the_local_ranges():
    ray = pytest.importorskip("ray")
    model = toy_models.build("conv_add_relu", seed=1)
    feeds = toy_models.random_feeds(model, 8, seed=3)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = collect_ranges_sharded(model, _split(feeds, [3, 5]), "percentile", engine="ray")
    finally:
        ray.shutdown()
    assert dict(on_ray) == dict(collect_ranges_sharded(model, [feeds], "percentile"))
