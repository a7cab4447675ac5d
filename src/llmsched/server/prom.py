"""Lock-free metric primitives rendered through prometheus_client's exposition code.

The server updates its metrics only on the event loop (and /metrics reads
them there), so plain integers and lists replace prometheus_client's
locked metric objects: a token costs an addition, not a lock round trip.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client.core import HistogramMetricFamily


class Histogram:
    """Bucketed observations with Prometheus semantics (``le`` bounds are inclusive)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = sorted(float(b) for b in bounds)
        # One slot per bound plus +Inf.
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def family(self, name: str, documentation: str, labels: dict[str, str]) -> HistogramMetricFamily:
        """The histogram as a prometheus_client metric family (cumulative buckets)."""
        fam = HistogramMetricFamily(name, documentation, labels=list(labels))
        cumulative = 0
        buckets = []
        for bound, c in zip(self.bounds, self.counts):
            cumulative += c
            buckets.append((_le(bound), cumulative))
        buckets.append(("+Inf", self.count))
        fam.add_metric(list(labels.values()), buckets, self.sum)
        return fam


def _le(bound: float) -> str:
    return str(int(bound)) + ".0" if bound == int(bound) else repr(bound)


def token_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (vLLM's request-token buckets)."""
    out: list[float] = []
    mantissas = (1, 2, 5)
    exponent = 0
    while True:
        for m in mantissas:
            v = m * 10**exponent
            if v > max_len:
                return out
            out.append(float(v))
        exponent += 1
