"""Streaming per-tensor statistics in bounded memory, and the range rules computed from them.

A :class:`StreamingHistogram` keeps the exact min/max and a histogram of ``bins`` equal-width bins.
When new data falls outside the covered interval, the bin width doubles (adjacent bins are summed
pairwise, which is exact) and the freed half of the bins is added on the side that needs it, until
the data fits. Memory per tensor is therefore fixed (``bins`` int64 counters), whatever the number
of samples, and the covered interval is never more than about four times the data's extent, so at
least ``bins / 4`` bins describe the data.

Range rules (all return ``(lo, hi)``):

* ``minmax``: the exact observed min and max.
* ``percentile``: clips ``(100 - p) / 2`` percent of the mass on each side (ORT's asymmetric rule).
* ``entropy``: the clipping window ``[lo, hi]`` that minimises KL(P || Q) between the clipped
  histogram P of the non-zero values (exact zeros, which the zero point represents without error,
  are left out; outliers folded into the edge bins) and its quantization Q onto ``levels`` levels
  (TensorRT's method, generalised to an asymmetric window). Candidates are ``lo = s*L`` and
  ``hi = t*H`` (``L = min(min, 0)``, ``H = max(max, 0)``, s and t geometric in [1/64, 1]), searched
  by coordinate descent (upper, lower, upper, lower).
* ``mse``: the window that minimises the expected squared error of uniform quantization onto
  ``levels`` levels: rounding noise ``step**2 / 12`` inside plus clipping error outside, over all
  candidate (lo, hi) pairs (exact zeros left out: they have no rounding noise).
"""

from __future__ import annotations

import numpy as np

__all__ = ["StreamingHistogram", "PercentileTails", "METHODS", "range_from_histogram"]

METHODS = ("minmax", "percentile", "entropy", "mse")
DEFAULT_BINS = 8192
_LEVELS = 256  # 8-bit activations
_CANDIDATES = 160  # clipping windows tried by entropy and mse
_CHUNK = 1 << 18  # values binned at a time: 1 MB of float32 positions, 2 MB of indices
_TAIL_CHUNK = 1 << 16  # values PercentileTails reads at a time: 256 KB, in a core's L2
# ufunc.at got its fast path in numpy 1.25: from then on, counting the indices one by one beats a
# bincount over every bin at every size (numpy 2.4, 8192 bins: 2,048 values 3.4 vs 5.5 us, 16,384
# 19 vs 28 us, 1M 1.2 vs 1.7 ms, a Relu's output); before, it costs ~1 us a value
_FAST_UFUNC_AT = np.lib.NumpyVersion(np.__version__) >= "1.25.0"


class StreamingHistogram:
    """Exact min/max plus a fixed-size histogram whose range grows by exact bin merging."""

    COUNTS_ZEROS = True  # entropy and mse leave exact zeros out

    def __init__(self, bins: int = DEFAULT_BINS, keep_histogram: bool = True, count_zeros: bool = True):
        """``count_zeros=False``: for a range that counts zeros in (minmax, percentile), one pass
        over each array less; :meth:`trimmed` then refuses to leave them out."""
        if bins < 16 or bins % 2:
            raise ValueError("bins must be an even number >= 16")
        self.bins = bins
        self.keep_histogram = keep_histogram
        self.counts_zeros = count_zeros and self.COUNTS_ZEROS
        self.count = 0
        self.zeros = 0  # exact zeros (ReLU outputs): quantized without error, whatever the range
        self.minimum = np.inf
        self.maximum = -np.inf
        self.lo = 0.0
        self.width = 0.0
        self.counts = np.zeros(bins, np.int64) if keep_histogram else np.zeros(0, np.int64)

    @property
    def hi(self) -> float:
        """Upper edge of the covered interval."""
        return self.lo + self.width * self.bins

    def update(self, array: np.ndarray) -> None:
        """Add the finite values of ``array`` to the statistics."""
        values = np.asarray(array, dtype=np.float32).reshape(-1)
        if values.size == 0:
            return
        low, high = float(values.min()), float(values.max())
        if not (np.isfinite(low) and np.isfinite(high)):
            values = values[np.isfinite(values)]
            if values.size == 0:
                return
            low, high = float(values.min()), float(values.max())
        self.count += values.size
        if self.counts_zeros:
            self.zeros += int(np.count_nonzero(values == 0))
        self.minimum, self.maximum = min(self.minimum, low), max(self.maximum, high)
        if self.keep_histogram:
            self._cover(low, high)
            self._add(values)

    def cover(self, low: float, high: float) -> None:
        """Cover ``[low, high]`` before any sample: with the extremes of all the samples, the bins never
        regrow, and two histograms covered alike sum exactly (:meth:`merge`)."""
        if self.count:
            raise ValueError("cover() comes before the first sample")
        if np.isfinite(low) and np.isfinite(high) and low <= high:
            self._cover(float(low), float(high))

    def merge(self, other: StreamingHistogram) -> None:
        """Add ``other``'s statistics: exact where both cover the same bins (see :meth:`cover`)."""
        if other.count == 0:
            return
        if self.keep_histogram:
            if self.width == 0.0:
                self.lo, self.width, self.counts = other.lo, other.width, other.counts.copy()
            elif (self.lo, self.width, self.bins) != (other.lo, other.width, other.bins):
                raise ValueError("histograms over different bins do not merge exactly")
            else:
                self.counts = self.counts + other.counts
        self.count += other.count
        self.zeros += other.zeros
        self.minimum, self.maximum = min(self.minimum, other.minimum), max(self.maximum, other.maximum)

    def _cover(self, low: float, high: float) -> None:
        """Grow the covered interval (exactly, by doubling the bin width) until it holds [low, high]."""
        if self.width == 0.0:
            span = max(high - low, 1e-6 * max(abs(low), abs(high), 1.0))
            self.width = span / self.bins * (1 + 1e-6)
            self.lo = low
            return
        while low < self.lo or high >= self.hi:
            downward = low < self.lo
            if downward:
                self.lo -= self.width * self.bins
            self._double(downward)
            self.width *= 2

    def _double(self, downward: bool) -> None:
        """Sum adjacent bins pairwise; the freed half goes below (``downward``) or above."""
        self.counts = _doubled(self.counts, downward)

    def _add(self, values: np.ndarray) -> None:
        # a chunk at a time through two scratch buffers that stay in cache (a whole feature map's
        # temporaries are fresh allocations larger than the cache: a quarter less time on a PP-OCR
        # detector's 544x736 maps), in float32, clipped before the cast to integers (truncation
        # is monotone and keeps 0 and bins - 1, so clipping first gives the same bins)
        chunk = min(values.size, _CHUNK)
        positions, indices = np.empty(chunk, np.float32), np.empty(chunk, np.intp)
        scale = np.float32(1.0 / self.width)
        for start in range(0, values.size, chunk):
            part = values[start:start + chunk]
            position, index = positions[:part.size], indices[:part.size]
            np.subtract(part, np.float32(self.lo), out=position)
            position *= scale
            np.clip(position, 0, self.bins - 1, out=position)
            np.copyto(index, position, casting="unsafe")
            if _FAST_UFUNC_AT:  # the same counts, without a bincount's pass and array over every bin
                np.add.at(self.counts, index, 1)
            else:
                self.counts += np.bincount(index, minlength=self.bins)

    def _index(self, value: float) -> int:
        """The bin :meth:`_add` puts ``value`` in (the same float32 arithmetic)."""
        position = (np.float32(value) - np.float32(self.lo)) * np.float32(1.0 / self.width)
        # np.clip's clamp and truncation in Python: a tenth of the time on one value
        return int(min(max(float(position), 0.0), self.bins - 1))

    def trimmed(self, exclude_zeros: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(counts, edges) of the occupied part of the histogram; ``exclude_zeros`` leaves out the
        exact zeros (from the bin that holds 0.0)."""
        if exclude_zeros and not self.counts_zeros:
            raise ValueError("this histogram did not count its zeros: it cannot leave them out")
        counts = self.counts
        if exclude_zeros and self.zeros and self.width > 0 and self.lo <= 0.0 < self.hi:
            counts = counts.copy()
            counts[int((0.0 - self.lo) / self.width)] -= self.zeros
        nonzero = np.flatnonzero(counts)
        if nonzero.size == 0:
            return np.zeros(1, np.int64), np.array([self.minimum, self.maximum], np.float64)
        first, last = nonzero[0], nonzero[-1] + 1
        edges = self.lo + self.width * np.arange(first, last + 1, dtype=np.float64)
        edges[0], edges[-1] = max(edges[0], self.minimum), min(edges[-1], self.maximum)
        return counts[first:last], edges


def _doubled(counts: np.ndarray, downward: bool) -> np.ndarray:
    merged = counts.reshape(-1, 2).sum(axis=1)
    empty = np.zeros(counts.size // 2, counts.dtype)
    return np.concatenate([empty, merged] if downward else [merged, empty])


class PercentileTails(StreamingHistogram):
    """The histogram a percentile range needs, binning only the tails; ``percentile_range`` is then
    the same as :func:`range_from_histogram` of a :class:`StreamingHistogram` fed the same arrays.

    The first update picks two thresholds with ``TAIL_MARGIN`` times the percentile's cut of its
    values beyond each (0.4% for 99.99%). Values beyond a threshold are binned as usual; a value
    many inputs take (a Relu's 0) is counted in its bin; the other values between the thresholds
    (nearly all) are only counted: into the upper threshold's bin, and ``deferred_high`` /
    ``deferred_low`` record that mass at both thresholds' bins. Binning is monotone in the value,
    so each such value's true bin lies between the two, and the cumulative counts are bounded on
    both sides. :meth:`percentile_range` returns the range only where those bounds prove that both
    percentile bins, and the first and last occupied bins, are the ones the full histogram has;
    otherwise None (measure the tensor again with a :class:`StreamingHistogram`). Each value is
    read once from memory and compared in cache: 0.47-0.56 ns a value, against 2.1-2.6 ns to bin it
    (``benchmarks/histogram_tails_speed.py``).
    """

    TAIL_MARGIN = 80
    COUNTS_ZEROS = False  # a percentile counts them in
    _SAMPLE = 1 << 14  # values of the first update the thresholds are chosen from

    def __init__(self, bins: int = DEFAULT_BINS, percentile: float = 99.99):
        super().__init__(bins)
        self.tail_share = min(0.25, self.TAIL_MARGIN * _cut(percentile))
        self.thresholds: tuple[np.float32, np.float32] | None = None
        self.spikes: tuple[np.float32, ...] = ()
        # bin -> counted values: a few bins each, not two more histograms per tensor
        self.deferred_high: dict[int, int] = {}
        self.deferred_low: dict[int, int] = {}

    def _double(self, downward: bool) -> None:
        super()._double(downward)
        self.deferred_high, self.deferred_low = (_sparse(_doubled(self._dense(deferred), downward))
                                                 for deferred in (self.deferred_high, self.deferred_low))

    def _pick_thresholds(self, values: np.ndarray) -> None:
        sample = values[::max(1, values.size // self._SAMPLE)]
        k = max(1, int(sample.size * self.tail_share)) - 1
        ordered = np.partition(sample, (k, sample.size - 1 - k))
        low, high = ordered[k], ordered[sample.size - 1 - k]
        self.thresholds = low, high
        # a value many inputs take (a Relu's 0, a Relu6's 6) is counted in its bin: deferred,
        # its mass would blur the bounds where the percentile lies
        self.spikes = tuple(threshold for threshold in dict.fromkeys((low, high))
                            if np.count_nonzero(sample == threshold) > k)

    def update(self, array: np.ndarray) -> None:
        """As :meth:`StreamingHistogram.update`, in one pass over memory: each cache-sized chunk
        gives its min, max and tail values, and only the tails are binned once the range is covered."""
        values = np.asarray(array, dtype=np.float32).reshape(-1)
        if values.size == 0:
            return
        if self.thresholds is None:
            finite = values if np.isfinite(values).all() else values[np.isfinite(values)]
            if finite.size == 0:
                return
            self._pick_thresholds(finite)
        low, high = self.thresholds
        chunk = min(values.size, _TAIL_CHUNK)
        masks, scratches = np.empty(chunk, bool), np.empty(chunk, bool)
        tails, spikes = [], [0] * len(self.spikes)
        for start in range(0, values.size, chunk):
            part = values[start:start + chunk]
            outside, scratch = masks[:part.size], scratches[:part.size]
            # not low <= value <= high: the tails, and NaN, which fails both comparisons
            np.greater_equal(part, low, out=outside)
            outside &= np.less_equal(part, high, out=scratch)
            np.logical_not(outside, out=outside)
            tails.append(np.compress(outside, part))
            for index, spike in enumerate(self.spikes):
                spikes[index] += int(np.count_nonzero(np.equal(part, spike, out=scratch)))
        binned = np.concatenate(tails)
        # The extremes lie in the tails. Without a tail on a side, that side's extreme is within the
        # thresholds, values of the first update: it is the threshold itself in the first update
        # (the threshold is one of its values), and later it moves neither the covered interval nor
        # the minimum / maximum so far, which hold the first update's values; so the threshold
        # stands in for it, with the same effect.
        smallest, largest = float(low), float(high)
        if binned.size:
            tail_low, tail_high = float(binned.min()), float(binned.max())  # NaN propagates
            if not (np.isfinite(tail_low) and np.isfinite(tail_high)):  # NaN/inf: as the base class, finite values only
                finite = values[np.isfinite(values)]
                if finite.size:
                    self.update(finite)
                return
            smallest, largest = min(smallest, tail_low), max(largest, tail_high)
        self.count += values.size
        self.minimum, self.maximum = min(self.minimum, smallest), max(self.maximum, largest)
        self._cover(smallest, largest)
        if binned.size:
            self._add(binned)
        between = values.size - binned.size - sum(spikes)
        for spike, at_spike in zip(self.spikes, spikes):
            self.counts[self._index(spike)] += at_spike
        high_bin = self._index(high)
        self.counts[high_bin] += between
        low_bin = self._index(low)
        self.deferred_high[high_bin] = self.deferred_high.get(high_bin, 0) + between
        self.deferred_low[low_bin] = self.deferred_low.get(low_bin, 0) + between

    def _dense(self, deferred: dict[int, int]) -> np.ndarray:
        dense = np.zeros(self.bins, np.int64)
        for index, count in deferred.items():
            dense[index] += count
        return dense

    def percentile_range(self, percentile: float = 99.99) -> tuple[float, float] | None:
        """The range :func:`range_from_histogram` gives with the full histogram, or None where the
        deferred values could change it."""
        if self.count == 0:
            return 0.0, 0.0
        if self.minimum == self.maximum:
            return float(self.minimum), float(self.maximum)
        deferred_high, deferred_low = self._dense(self.deferred_high), self._dense(self.deferred_low)
        exact = self.counts - deferred_high
        occupied_low = np.flatnonzero(exact + deferred_low)
        occupied_high = np.flatnonzero(self.counts)
        if occupied_low[0] != occupied_high[0] or occupied_low[-1] != occupied_high[-1]:
            return None
        counts, edges = self.trimmed()
        first, last = occupied_high[0], occupied_high[-1] + 1
        # true cumulative count <= stored + the deferred mass that may lie lower
        upper = np.cumsum(counts) + np.cumsum(deferred_low[first:last]) - np.cumsum(deferred_high[first:last])
        lo_index, hi_index = _percentile_indices(counts, percentile)
        cut, total = _cut(percentile), max(counts.sum(), 1)
        if lo_index > 0 and not upper[lo_index - 1] / total <= cut:
            return None
        if hi_index > 0 and not upper[hi_index - 1] / total < 1.0 - cut:
            return None
        lo, hi = _edges_at(counts, edges, lo_index, hi_index)
        return max(lo, float(self.minimum)), min(hi, float(self.maximum))


def _sparse(dense: np.ndarray) -> dict[int, int]:
    return {int(index): int(dense[index]) for index in np.flatnonzero(dense)}


def _cut(percentile: float) -> float:
    """The share of the values a two-sided ``percentile`` clips on each side."""
    return (100.0 - percentile) / 200.0


def _percentile_indices(counts: np.ndarray, percentile: float) -> tuple[int, int]:
    cut = _cut(percentile)
    cdf = np.cumsum(counts) / max(counts.sum(), 1)
    return int(np.searchsorted(cdf, cut, side="right")), int(np.searchsorted(cdf, 1.0 - cut, side="left"))


def _edges_at(counts: np.ndarray, edges: np.ndarray, lo_index: int, hi_index: int) -> tuple[float, float]:
    """The lower edge of bin ``lo_index`` and the upper edge of bin ``hi_index``."""
    return float(edges[min(lo_index, len(counts) - 1)]), float(edges[min(hi_index, len(counts) - 1) + 1])


def _percentile_range(counts: np.ndarray, edges: np.ndarray, percentile: float) -> tuple[float, float]:
    return _edges_at(counts, edges, *_percentile_indices(counts, percentile))


def _candidates(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidate lower and upper clipping points: s*L and s*H for s from 1/64 to 1 (geometric)."""
    low, high = min(edges[0], 0.0), max(edges[-1], 0.0)
    scales = np.geomspace(1.0 / 64, 1.0, _CANDIDATES)
    return scales * low, scales * high


def _mse_range(counts: np.ndarray, edges: np.ndarray, levels: int) -> tuple[float, float]:
    """Every (lo, hi) pair of candidates; the error splits into per-side clipping terms plus rounding noise."""
    centers = 0.5 * (edges[:-1] + edges[1:])
    counts = counts.astype(np.float64)
    lows, highs = _candidates(edges)
    below = np.maximum(lows[:, None] - centers[None, :], 0.0)
    above = np.maximum(centers[None, :] - highs[:, None], 0.0)
    clip_low, clip_high = (below**2) @ counts, (above**2) @ counts
    n_low, n_high = (below > 0) @ counts, (above > 0) @ counts
    inside = counts.sum() - n_low[:, None] - n_high[None, :]
    steps = (highs[None, :] - lows[:, None]) / (levels - 1)
    error = clip_low[:, None] + clip_high[None, :] + inside * steps**2 / 12.0
    i, j = np.unravel_index(int(np.argmin(error)), error.shape)
    return float(lows[i]), float(highs[j])


def _kl_divergence(counts: np.ndarray, centers: np.ndarray, low: float, high: float, levels: int) -> float:
    """KL(P || Q): P = histogram clipped to [low, high] (outliers folded into the edge bins), Q = P on levels."""
    inside = (centers >= low) & (centers <= high)
    if inside.sum() < levels:  # fewer bins than levels: quantization is lossless at this resolution
        return np.inf
    sliced = counts[inside].astype(np.float64)
    p = sliced.copy()
    p[0] += counts[centers < low].sum()
    p[-1] += counts[centers > high].sum()
    level = np.minimum(((centers[inside] - low) / (high - low) * levels).astype(np.int64), levels - 1)
    mass = np.bincount(level, weights=sliced, minlength=levels)
    occupied = np.bincount(level, weights=(sliced > 0).astype(np.float64), minlength=levels)
    q = np.where(sliced > 0, mass[level] / np.maximum(occupied[level], 1), 0.0)
    p /= p.sum()
    q_total = q.sum()
    if q_total == 0:
        return np.inf
    q /= q_total
    support = p > 0
    q = np.maximum(q, 1e-12)
    return float(np.sum(p[support] * np.log(p[support] / q[support])))


def _entropy_range(counts: np.ndarray, edges: np.ndarray, levels: int) -> tuple[float, float]:
    """Coordinate descent on KL: best upper point with the lower one fixed, then the reverse, twice."""
    centers = 0.5 * (edges[:-1] + edges[1:])
    lows, highs = _candidates(edges)
    lo, hi = float(lows[-1]), float(highs[-1])
    if lo == hi:
        return float(edges[0]), float(edges[-1])
    for _ in range(2):
        if hi > 0:
            hi = _best(highs, lambda h: _kl_divergence(counts, centers, lo, h, levels), hi)
        if lo < 0:
            lo = _best(lows, lambda low: _kl_divergence(counts, centers, low, hi, levels), lo)
    return lo, hi


def _best(candidates: np.ndarray, divergence, current: float) -> float:
    """The candidate of least divergence, ``current`` if none is finite."""
    values = np.array([divergence(c) for c in candidates])
    if not np.isfinite(values.min()):
        return current
    return float(candidates[int(np.argmin(values))])


def range_from_histogram(
    histogram: StreamingHistogram, method: str, percentile: float = 99.99, levels: int = _LEVELS
) -> tuple[float, float]:
    """The ``(lo, hi)`` range of one tensor under ``method`` (see the module docstring)."""
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; known: {METHODS}")
    if isinstance(histogram, PercentileTails):
        raise ValueError("a PercentileTails histogram gives only its percentile_range()")
    if histogram.count == 0:
        return 0.0, 0.0
    if method == "minmax" or histogram.minimum == histogram.maximum:
        return float(histogram.minimum), float(histogram.maximum)
    if not histogram.keep_histogram:
        raise ValueError(f"method {method!r} needs a histogram; this collector kept min/max only")
    # Exact zeros (the spike a ReLU leaves) are represented exactly by the zero point: they must not
    # weigh in the error a window is chosen by. Left in, KL sees a spike smeared over a whole
    # quantization level and clips ReLU6 outputs to 1/7 of their range (MobileNetV2: cosine 0.47).
    counts, edges = histogram.trimmed(exclude_zeros=method in ("entropy", "mse"))
    if method == "percentile":
        lo, hi = _percentile_range(counts, edges, percentile)
    elif method == "mse":
        lo, hi = _mse_range(counts, edges, levels)
    else:
        lo, hi = _entropy_range(counts, edges, levels)
    return max(lo, float(histogram.minimum)), min(hi, float(histogram.maximum))
