"""Per-value cost of a full StreamingHistogram against PercentileTails, and that their ranges agree.

    python benchmarks/histogram_tails_speed.py

Four activation-like distributions (450 000 float32 values, as a mid-size feature map), one
warm update then 100 timed updates each; prints nanoseconds per value and checks the 99.99% range.
"""

from __future__ import annotations

import time

import numpy as np

from kenosis_rewrite.calibration import PercentileTails, StreamingHistogram, range_from_histogram


def main() -> None:
    rng = np.random.default_rng(1)
    normal = rng.standard_normal(450_000)
    arrays = {"normal": normal, "relu": np.maximum(normal, 0), "relu6": np.clip(3 * normal, 0, 6),
              "sigmoid": 1 / (1 + np.exp(-4 * normal))}
    for kind, values in arrays.items():
        values = values.astype(np.float32)
        full, tails = StreamingHistogram(), PercentileTails()
        line = []
        for histogram in (full, tails):
            histogram.update(values)
            start = time.perf_counter()
            for _ in range(100):
                histogram.update(values)
            line.append((time.perf_counter() - start) / 100 / values.size * 1e9)
        same = tails.percentile_range(99.99) == range_from_histogram(full, "percentile", 99.99)
        print(f"{kind:8s} full {line[0]:.2f} ns/value, tails {line[1]:.2f} ns/value, same 99.99% range: {same}")


if __name__ == "__main__":
    main()
