"""sim_vs_real's holding rule: inside the real runs' range or within 10% of their median."""

from __future__ import annotations

import math

import pytest
from sim_vs_real_spread import judge, longest_streak

RUNS = [100.0, 130.0, 90.0, 150.0, 110.0]  # median 110, range 90-150


def test_a_prediction_inside_the_runs_range_holds_though_far_from_the_median() -> None:
    h = judge(RUNS, 145.0, 0.10)
    assert h.in_range and not h.near_median and h.holds
    assert h.why(0.10) == "in range"
    assert h.error == pytest.approx(145 / 110 - 1)


def test_a_prediction_outside_the_range_holds_within_the_target_of_the_median() -> None:
    # A tight range: 119 is outside 100-118 but 8.2% from the median 110.
    h = judge([100.0, 110.0, 118.0], 119.0, 0.10)
    assert not h.in_range and h.near_median and h.holds
    assert h.why(0.10) == "within 10%"


def test_a_prediction_outside_the_range_and_beyond_the_target_misses() -> None:
    h = judge(RUNS, 151.0, 0.10)
    assert not h.holds and h.why(0.10) == "misses"
    assert not judge(RUNS, 89.0, 0.10).holds
    # Within 10% of the minimum run but not of the median: the median decides, not any run.
    assert not judge([100.0, 200.0, 210.0], 95.0, 0.10).holds


def test_the_ends_of_the_range_and_of_the_target_band_count() -> None:
    assert judge(RUNS, 90.0, 0.10).holds and judge(RUNS, 150.0, 0.10).holds
    assert judge([100.0], 110.0, 0.10).holds and judge([100.0], 90.0, 0.10).holds
    assert not judge([100.0], 110.5, 0.10).holds


def test_one_run_is_the_old_rule_within_the_target_of_that_run() -> None:
    assert judge([20.0], 21.9, 0.10).holds
    assert not judge([20.0], 22.1, 0.10).holds


def test_the_spread_is_max_over_min_and_a_zero_median_is_met_only_by_the_range() -> None:
    assert judge(RUNS, 0.0, 0.10).spread == pytest.approx(150 / 90)
    h = judge([0.0, 0.0, 1.0], 0.5, 0.10)
    assert math.isnan(h.error) and h.holds and h.spread == math.inf
    assert not judge([0.0, 0.0, 0.0], 0.5, 0.10).holds


def test_no_runs_or_a_target_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one real run"):
        judge([], 1.0, 0.10)
    with pytest.raises(ValueError, match="target error"):
        judge(RUNS, 1.0, 1.5)


def test_longest_streak_counts_consecutive_passes() -> None:
    assert longest_streak([True, True, False, True, True, True, False]) == 3
    assert longest_streak([False, False]) == 0
