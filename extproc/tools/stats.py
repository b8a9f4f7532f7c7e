"""The one percentile rule the simulator, load generator, demo and calibration report with."""

from __future__ import annotations

import math


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an already sorted list; NaN when empty. Until 2026-12-06 the rank
    was round(q% of n + 0.5), which took the next rank where q x n / 100 was an odd whole number (the p99 of 100
    values was the largest): the tables in docs/ measured before then were made with that rule."""
    if not sorted_values:
        return float("nan")
    # ceil(q% of n), rounded first so that 0.95 * 100 reads 95 (round(x + 0.5) halved to even: the p99 of 100 was
    # rank 100, of 200 rank 198)
    rank = max(1, min(len(sorted_values), math.ceil(round(q * len(sorted_values) / 100, 9))))
    return sorted_values[rank - 1]
