"""sim_vs_real's verdict: figures judged against every real run, a scenario held when all its figures are."""

from __future__ import annotations

import pytest
from sim_vs_real import FIGURES, compare, summarize


def summary(scale: float) -> dict:
    """A real run's (or the simulation's) figures, all ``scale`` times a base value."""
    return {key: 10.0 * scale for key, _ in FIGURES}


def result(name: str, real: list[dict], sim: dict) -> dict:
    return {"scenario": name, "figures": compare(real, sim), "real": {"runs": len(real), "disturbed_runs": 0}}


def test_compare_judges_every_figure_against_the_runs_and_keeps_the_error_to_each_run() -> None:
    real = [summary(s) for s in (1.0, 1.5, 1.2)]
    figs = compare(real, summary(1.45))
    assert set(figs) == {key for key, _ in FIGURES}
    f = figs["mean_tpot_ms"]
    assert f["holds"] and f["why"] == "in range"
    assert (f["median"], f["min"], f["max"]) == (12.0, 10.0, 15.0)
    assert f["error"] == pytest.approx(14.5 / 12 - 1)
    assert f["run_errors"] == pytest.approx([0.45, 14.5 / 15 - 1, 14.5 / 12 - 1])
    assert not compare(real, summary(1.6))["mean_tpot_ms"]["holds"]


def test_a_scenario_holds_only_when_every_figure_does_and_the_old_per_run_view_stays() -> None:
    real = [summary(s) for s in (1.0, 1.04, 1.3)]
    good = result("good", real, summary(1.2))  # in range: holds; within 10% of run 3 only
    sim = summary(1.2)
    sim["p90_ttft_ms"] = 10.0 * 1.5  # one figure out of range and 44% over the median
    bad = result("bad", real, sim)
    verdict = summarize([good, bad], {"settled": True}, 1.0)
    assert verdict["scenarios_within_target"] == ["good"]
    assert verdict["figures_holding"] == 2 * len(FIGURES) - 1
    assert verdict["scenarios_within_target_per_run"] == [[], [], ["good"]]
    assert verdict["worst_error"] == pytest.approx(1.5 / 1.04 - 1)
