"""Timings that must settle and agree before they count as a calibration figure.

A first call of a kernel is slow (oneDNN builds the primitive, pages fault
in, the caches and the branch predictors are cold), and a virtual CPU may
ramp its clock or lose a core to a neighbour for a while, so a figure is
taken only once consecutive readings agree: calls are repeated, after a
warm-up, until the last ``agree`` readings lie within ``tolerance`` of each
other, and their median is the figure. A measurement that never settles
within ``max_calls`` says so. Steady readings can still be steadily slow
(a neighbour holding one core for the whole window), so every window is
also checked for other processes' CPU time (``machine_load``), and a
disturbed or unsettled figure is measured again, up to ``attempts`` times.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from llmsched.sim import machine_load


@dataclass(frozen=True, slots=True)
class Limits:
    """How hard a figure is made to settle, and how much disturbance it tolerates."""

    agree: int = 3
    tolerance: float = 0.05
    max_calls: int = 20
    # Readings shorter than this repeat the call inside them: the clock and
    # the scheduler's tick make shorter ones noisy.
    min_reading_s: float = 0.02
    # A figure still unsettled after this long gives up (unsettled).
    max_seconds: float = 10.0
    attempts: int = 3
    max_foreign_share: float = 0.1


@dataclass(frozen=True, slots=True)
class Settled:
    """Seconds per call of a settled (or not) series of readings."""

    seconds: float
    spread: float
    calls: int
    settled: bool
    readings: int


@dataclass(frozen=True, slots=True)
class Reading:
    """One calibration figure with its evidence: spread, calls, settling, disturbance."""

    name: str
    value: float
    spread: float
    calls: int
    settled: bool
    foreign_share: float
    attempts: int
    readings: int = 0

    def clean(self, limits: Limits) -> bool:
        """Settled, and no more than the tolerated share of the cores went to other processes."""
        return self.settled and self.foreign_share <= limits.max_foreign_share

    def problem(self, limits: Limits) -> str | None:
        """Why the figure cannot be trusted, or None."""
        why = []
        if self.foreign_share > limits.max_foreign_share:
            why.append(
                f"other processes used {100 * self.foreign_share:.0f}% of the cores while it was measured "
                f"(limit {100 * limits.max_foreign_share:.0f}%)"
            )
        if not self.settled and self.readings < limits.agree:
            why.append(f"did not settle: {self.readings} readings in the {limits.max_seconds:g} s allowed")
        elif not self.settled:
            why.append(
                f"did not settle: its last {limits.agree} readings spread {100 * self.spread:.0f}% "
                f"(limit {100 * limits.tolerance:.0f}%)"
            )
        return f"{self.name}: {', and '.join(why)}" if why else None

    def to_dict(self) -> dict:
        """Plain-dict form (for the calibration record)."""
        return asdict(self)


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / max(min(xs), 1e-12)


def settle(run: Callable[[], object], limits: Limits) -> Settled:
    """Time ``run`` until ``limits.agree`` consecutive readings agree within the tolerance."""
    start = time.perf_counter()
    run()  # the cold call: never counted
    t = time.perf_counter()
    run()
    first = time.perf_counter() - t
    inner = max(1, math.ceil(limits.min_reading_s / max(first, 1e-9)))
    readings: list[float] = []
    calls = 2
    while calls < limits.max_calls * inner + 2:
        t = time.perf_counter()
        for _ in range(inner):
            run()
        readings.append((time.perf_counter() - t) / inner)
        calls += inner
        last = readings[-limits.agree :]
        if len(last) == limits.agree and _spread(last) <= limits.tolerance:
            return Settled(statistics.median(last), _spread(last), calls, True, len(readings))
        if time.perf_counter() - start > limits.max_seconds:
            break
    last = readings[-limits.agree :]
    return Settled(statistics.median(last), _spread(last), calls, False, len(readings))


def measure(name: str, work: float, run: Callable[[], object], limits: Limits) -> Reading:
    """``work`` per second of ``run``, settled and undisturbed if ``limits.attempts`` allow."""
    best: Reading | None = None
    for attempt in range(1, limits.attempts + 1):
        before = machine_load.sample()
        s = settle(run, limits)
        share = machine_load.foreign_share(before, machine_load.sample())
        share = round(share, 3)
        r = Reading(name, work / s.seconds, s.spread, s.calls, s.settled, share, attempt, s.readings)
        if r.clean(limits):
            return r
        # Keep the least disturbed attempt; a settled one before an unsettled one.
        if best is None or (not r.settled, r.foreign_share) < (not best.settled, best.foreign_share):
            best = r
    assert best is not None
    return best
