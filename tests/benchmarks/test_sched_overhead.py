"""sched_overhead measures vLLM 0.33's default mode, async scheduling, with as many runs per side."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
import sched_overhead

from llmsched.bench.workload import parse_workload


def test_default_configuration_is_async() -> None:
    args = sched_overhead.build_parser().parse_args([])
    assert args.modes == ["async"]
    wl = sched_overhead.make_workload(args.num_requests, args.prompt_len, args.output_len, args.modes[0])
    assert wl["config"]["async_scheduling"] is True
    # The replay that times llmsched's side runs the engine's batch queue.
    assert parse_workload(wl).scheduler_config().async_scheduling is True


def test_make_workload_defaults_to_async_and_sync_is_asked_for() -> None:
    assert sched_overhead.make_workload(4, 8, 2)["config"]["async_scheduling"] is True
    assert sched_overhead.make_workload(4, 8, 2, "sync")["config"]["async_scheduling"] is False
    with pytest.raises(ValueError, match="'eager' is not one of async, sync"):
        sched_overhead.make_workload(4, 8, 2, "eager")


def test_modes_flag_puts_sync_beside_async() -> None:
    args = sched_overhead.build_parser().parse_args(["--modes", "async,sync"])
    assert args.modes == ["async", "sync"]
    with pytest.raises(SystemExit):
        sched_overhead.build_parser().parse_args(["--modes", "async,async"])


def test_both_sides_get_the_same_runs_and_the_median(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three runs a side, alternating; each side's figure is the median of its runs, not the best."""
    ours_medians = iter([2.0, 1.0, 3.0])
    vllm_medians = iter([20.0, 50.0, 10.0])
    real_run_llmsched = sched_overhead.run_llmsched
    vllm_calls: list[tuple[str, bool]] = []

    def fake_llmsched(wl: dict, trace_path: str | None) -> dict:
        assert wl["config"]["async_scheduling"] is True
        res = real_run_llmsched(wl, trace_path)
        return {
            **res,
            "steady_steps": 5,
            "median_ms": next(ours_medians),
            "p90_ms": 4.0,
            "cpu_median_ms": 1.0,
        }

    def fake_vllm(python: str, driver: str, wl_path: str, trace_path: str, detail: bool) -> dict:
        assert json.loads(Path(wl_path).read_text())["config"]["async_scheduling"] is True
        vllm_calls.append((trace_path, detail))
        # vLLM's decisions are llmsched's: its first trace is llmsched's first.
        shutil.copy(Path(trace_path).parent / "llmsched_async.jsonl", trace_path)
        return {"steady_steps": 5, "median_ms": next(vllm_medians), "p90_ms": 60.0, "cpu_median_ms": 8.0}

    monkeypatch.setattr(sched_overhead, "run_llmsched", fake_llmsched)
    monkeypatch.setattr(sched_overhead, "run_vllm", fake_vllm)
    driver = tmp_path / "drive_vllm.py"
    driver.write_text("")
    out = tmp_path / "result.json"
    argv = ["--num-requests", "6", "--prompt-len", "16", "--output-len", "3", "--repeats", "3"]
    argv += ["--vllm-python", "python", "--vllm-driver", str(driver), "--json", str(out)]
    assert sched_overhead.main(argv) == 0

    result = json.loads(out.read_text())
    assert result["mode"] == "async"
    assert result["runs_per_side"] == 3
    assert result["llmsched"]["runs"] == result["vllm"]["runs"] == 3
    assert result["llmsched"]["median_ms"] == statistics.median([2.0, 1.0, 3.0]) == 2.0
    assert result["vllm"]["median_ms"] == statistics.median([20.0, 50.0, 10.0]) == 20.0
    assert result["speedup_vs_vllm"] == 10.0
    assert result["cpu_speedup_vs_vllm"] == 8.0
    assert result["vllm"]["decisions_identical"] is True
    assert [detail for _, detail in vllm_calls] == [True, False, False]
    assert result["cpu_model"]
    assert "cpu: " in capsys.readouterr().out
