"""Small statistics helpers shared by the benchmarks and reports."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_ns(values_ns: Sequence[int]) -> dict[str, float]:
    """n, mean, p50, p90, p99 and max of nanosecond timings, in microseconds."""
    if not values_ns:
        return {"n": 0}
    us = [v / 1000.0 for v in values_ns]
    return {
        "n": len(us),
        "mean_us": round(sum(us) / len(us), 2),
        "p50_us": round(percentile(us, 50), 2),
        "p90_us": round(percentile(us, 90), 2),
        "p99_us": round(percentile(us, 99), 2),
        "max_us": round(max(us), 2),
    }
