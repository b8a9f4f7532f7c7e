"""The one percentile rule the simulator, load generator, demo and calibration report with."""

from __future__ import annotations

import math


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an already sorted list; NaN when empty. Where q x n / 100 is an odd
    whole number it takes the next rank (Python rounds 19.5 to 20): the p95 of 20 values is the largest, the p99
    of 100 the 100th. So it is never below the nearest-rank value; every table in docs/ was made with it, and it is
    kept so that they stay comparable (found by a review, 2026-12-06)."""
    if not sorted_values:
        return float("nan")
    # ceil(q% of n), rounded first so that 0.95 * 100 reads 95 (round(x + 0.5) halved to even: the p99 of 100 was
    # rank 100, of 200 rank 198)
    rank = max(1, min(len(sorted_values), math.ceil(round(q * len(sorted_values) / 100, 9))))
    return sorted_values[rank - 1]
