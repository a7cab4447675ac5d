"""Settling timings: warm-up until readings agree, and a verdict when they never do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmsched.sim import settle
from llmsched.sim.settle import Limits


def _fake_clock(monkeypatch, durations):
    """run() advances a fake clock by the next duration."""
    clock = {"t": 0.0}
    it = iter(durations)

    def run() -> None:
        clock["t"] += next(it)

    monkeypatch.setattr(settle, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))
    return run


def test_cold_calls_are_waited_out_and_the_agreeing_readings_count(monkeypatch):
    # A cold call, a ramp, then steady 0.1 s readings.
    run = _fake_clock(monkeypatch, [0.5, 0.3, 0.2, 0.15, 0.1, 0.1, 0.101, 0.2])
    s = settle.settle(run, Limits(agree=3, tolerance=0.05, max_calls=10, min_reading_s=0.0))
    assert s.settled
    assert s.seconds == pytest.approx(0.1)
    assert s.spread == pytest.approx(0.01)
    assert s.calls == 7


def test_readings_that_never_agree_are_not_settled(monkeypatch):
    run = _fake_clock(monkeypatch, [0.1, 0.1] + [0.1, 0.2] * 10)
    s = settle.settle(run, Limits(agree=3, tolerance=0.05, max_calls=6, min_reading_s=0.0))
    assert not s.settled
    assert s.spread == pytest.approx(1.0)


def test_short_calls_are_repeated_inside_a_reading(monkeypatch):
    run = _fake_clock(monkeypatch, [0.001] * 200)
    s = settle.settle(run, Limits(agree=3, max_calls=5, min_reading_s=0.01))
    assert s.settled
    assert s.seconds == pytest.approx(0.001)
    # Two warm-up calls, then three readings of ten calls.
    assert s.calls == 32


def test_a_disturbed_figure_is_measured_again_and_the_least_disturbed_kept(monkeypatch):
    shares = iter([0.6, 0.3, 0.4])
    monkeypatch.setattr(settle.machine_load, "sample", lambda: object())
    monkeypatch.setattr(settle.machine_load, "foreign_share", lambda a, b: next(shares))
    monkeypatch.setattr(settle, "settle", lambda run, limits: settle.Settled(0.5, 0.0, 5, True, 3))
    limits = Limits(attempts=3)
    r = settle.measure("peak", 10.0, lambda: None, limits)
    assert r.value == pytest.approx(20.0)
    assert (r.attempts, r.foreign_share) == (2, 0.3)
    assert not r.clean(limits)
    assert "other processes used 30%" in r.problem(limits)
