"""The cpu profile: measured once, cached on disk, re-measured on request."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmsched.executor.sim.hardware import load_hardware
from llmsched.sim import calibrate

FAKE = {
    "backend": "python",
    "peak_flops": 2.0e9,
    "mem_bandwidth": 8.0e9,
    "mem_capacity": 16.0 * 2**30,
    "seconds": 0.1,
    "measured_at": "now",
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(tmp_path))
    return tmp_path / calibrate.CACHE_FILE


def test_measure_gives_plausible_figures():
    r = calibrate.measure()
    assert r["backend"] in ("torch", "numpy", "python")
    # Even pure Python on a busy core manages a megaflop; no CPU copies a terabyte/s.
    assert 1e6 < r["peak_flops"] < 1e14
    assert 1e8 < r["mem_bandwidth"] < 1e12
    assert r["mem_capacity"] > 2**28


def test_calibration_is_cached_per_machine(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(calibrate, "measure", lambda: calls.append(1) or dict(FAKE))
    assert calibrate.calibration() == FAKE
    assert len(calls) == 1
    assert cache.is_file()
    stored = json.loads(cache.read_text())
    assert list(stored.values()) == [FAKE]
    # Second call: from disk.
    assert calibrate.calibration() == FAKE
    assert len(calls) == 1
    calibrate.calibration(recalibrate=True)
    assert len(calls) == 2


def test_cpu_profile_uses_the_calibration(cache, monkeypatch):
    monkeypatch.setattr(calibrate, "measure", lambda: dict(FAKE))
    h = load_hardware("cpu")
    assert h.name == "cpu"
    assert h.peak_flops_bf16 == FAKE["peak_flops"]
    assert h.mem_bandwidth == FAKE["mem_bandwidth"]
    assert h.mem_capacity == FAKE["mem_capacity"]
    assert h.peak_flops_fp8 is None


def test_corrupt_cache_is_remeasured(cache, monkeypatch):
    cache.write_text("{not json")
    monkeypatch.setattr(calibrate, "measure", lambda: dict(FAKE))
    assert calibrate.calibration()["peak_flops"] == FAKE["peak_flops"]
    assert json.loads(cache.read_text())


def test_cpu_profile_carries_the_measured_host_costs(cache, monkeypatch):
    figures = dict(
        FAKE,
        step_overhead_s=2e-3,
        layer_overhead_s=3e-4,
        request_overhead_s=1e-5,
        decode_kv_bandwidth=6e9,
    )
    monkeypatch.setattr(calibrate, "measure", lambda: figures)
    h = load_hardware("cpu")
    assert (h.step_overhead_s, h.layer_overhead_s, h.request_overhead_s) == (2e-3, 3e-4, 1e-5)
    assert h.decode_kv_bandwidth == 6e9


def test_profile_without_host_figures_keeps_the_defaults(cache, monkeypatch):
    monkeypatch.setattr(calibrate, "measure", lambda: dict(FAKE))
    h = load_hardware("cpu")
    assert h.step_overhead_s is None
    assert (h.layer_overhead_s, h.request_overhead_s) == (0.0, 0.0)


def test_a_failing_executor_probe_gives_none(monkeypatch):
    class Done:
        returncode = 1
        stdout = ""
        stderr = "ModuleNotFoundError: No module named 'safetensors'\n"

    monkeypatch.setattr(calibrate.subprocess, "run", lambda *a, **k: Done())
    assert calibrate._executor_figures({"peak_flops": 1e9}) is None


def test_a_disturbed_measurement_is_repeated_and_the_least_disturbed_kept(monkeypatch):
    # Other processes' CPU seconds per attempt: heavy, light, then none.
    foreign = iter([5.0, 0.05, 0.0])
    clock = {"busy": 0.0, "attempt": 0, "wall": 0.0}

    def busy() -> float:
        return clock["busy"]

    def once() -> dict:
        # Each attempt takes one second of wall time.
        clock["attempt"] += 1
        clock["busy"] += next(foreign)
        clock["wall"] += 1.0
        return {"attempt": clock["attempt"]}

    monkeypatch.setattr(calibrate, "_busy_seconds", busy)
    monkeypatch.setattr(calibrate, "_own_seconds", lambda: 0.0)
    monkeypatch.setattr(calibrate, "_measure_once", once)
    monkeypatch.setattr(calibrate, "time", SimpleNamespace(perf_counter=lambda: clock["wall"]))
    monkeypatch.setattr(calibrate.os, "cpu_count", lambda: 2)
    r = calibrate.measure()
    # The second attempt is within the tolerated share, so measuring stops there.
    assert r["attempt"] == 2
    assert clock["attempt"] == 2
    assert r["foreign_cpu_share"] <= calibrate._MAX_FOREIGN_SHARE
