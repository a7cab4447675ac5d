"""The cpu profile: measured once, cached on disk, re-measured on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from llmsched.sim import calibrate
from llmsched.sim.calibrate import load_hardware

FAKE = {
    "backend": "python",
    "peak_flops": 2.0e9,
    "mem_bandwidth": 8.0e9,
    "mem_capacity": 16.0 * 2**30,
    "seconds": 0.1,
    "measured_at": "now",
    "settled": True,
    "problems": [],
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(tmp_path))
    return tmp_path / calibrate.CACHE_FILE


def test_measure_gives_plausible_figures():
    r = calibrate.measure(quick=True)
    assert r["backend"] in ("torch", "numpy", "python")
    # Even pure Python on a busy core manages a megaflop; no CPU copies a terabyte/s.
    assert 1e6 < r["peak_flops"] < 1e14
    assert 1e8 < r["mem_bandwidth"] < 1e12
    assert r["mem_capacity"] > 2**28
    if r["backend"] == "torch":
        from llmsched.sim.calibrate_torch import compute_dtype, dtype_name

        # Timed in the dtype the executor runs here, and the profile says which.
        assert r["dtype"] == dtype_name(compute_dtype())
        assert r["dtype"] in calibrate.profile_from_calibration(r).description


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


def test_cpu_profile_covers_the_probed_batch_sizes_and_knows_whether_a_core_was_free():
    samples = [[1, 1, 4e4, 1e-3], [1, 32, 1e6, 2e-3], [4, 8, 2e6, 3e-3]]
    c = dict(FAKE, layer_overhead_s=3e-4, executor_samples=samples, machine={"cores": 2, "threads": 2})
    h = calibrate.profile_from_calibration(c)
    # The layer cost was fitted on steps of up to 32 decodes, with no core left for the host.
    assert (h.layer_overhead_covers_tokens, h.host_overlaps_model) == (32, False)
    h = calibrate.profile_from_calibration(dict(c, machine={"cores": 4, "threads": 3}))
    assert h.host_overlaps_model is True
    # Microbenchmarks only (no probe), machine unknown: nothing covered, overlap assumed.
    h = calibrate.profile_from_calibration(dict(FAKE))
    assert (h.layer_overhead_covers_tokens, h.host_overlaps_model) == (0, True)
    # Linears timed on their own (efficiency curves): their time adds to the layers' host time.
    h = calibrate.profile_from_calibration(dict(c, efficiency_curves={"gemm": [[1, 0.1]]}))
    assert h.layer_overhead_covers_tokens == 0
    assert h.efficiency_curves == {"gemm": [[1, 0.1]]}


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


def test_an_unsettled_calibration_is_returned_but_not_cached(cache, monkeypatch):
    bad = dict(FAKE, settled=False, problems=["peak_flops did not settle"])
    monkeypatch.setattr(calibrate, "measure", lambda: dict(bad))
    assert calibrate.calibration()["settled"] is False
    assert not cache.exists()
    h = load_hardware("cpu")
    assert "UNSETTLED: peak_flops did not settle" in h.description


def test_a_cached_calibration_survives_an_unsettled_recalibration(cache, monkeypatch):
    monkeypatch.setattr(calibrate, "measure", lambda: dict(FAKE))
    calibrate.calibration()
    monkeypatch.setattr(calibrate, "measure", lambda: dict(FAKE, settled=False, peak_flops=1e9))
    assert calibrate.calibration(recalibrate=True)["peak_flops"] == 1e9
    # The clean figures stay cached for the next run.
    assert calibrate.calibration()["peak_flops"] == FAKE["peak_flops"]


def test_probe_cross_check_flags_a_matmul_peak_that_disagrees():
    def reading(name: str, value: float) -> dict:
        return {
            "name": name,
            "value": value,
            "spread": 0.01,
            "calls": 5,
            "settled": True,
            "foreign_share": 0.0,
            "attempts": 1,
        }

    limits = calibrate.Limits()
    probe = {"readings": [reading("before", 400e9), reading("after", 410e9)], "fit_rms_error": 0.05}
    assert calibrate._probe_check(420e9, probe, limits) == []
    # The case: one process measured about half the other's peak.
    probe["readings"][0] = reading("before", 207e9)
    problems = calibrate._probe_check(427e9, probe, limits)
    assert len(problems) == 1 and "before" in problems[0] and "-52%" in problems[0]
    probe["fit_rms_error"] = 0.5
    assert len(calibrate._probe_check(427e9, probe, limits)) == 2


def _busy_neighbours(n: int) -> list[subprocess.Popen]:
    code = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def test_a_calibration_beside_a_cpu_heavy_process_is_flagged_and_not_cached(cache, monkeypatch):
    pytest.importorskip("torch")
    if calibrate.machine_load.busy_seconds() is None:
        pytest.skip("no /proc/stat: the machine's load cannot be read here")
    limits = calibrate.Limits(agree=3, max_calls=4, min_reading_s=0.003, max_seconds=0.3, attempts=1)
    # The real measurement at test sizes (no executor probe), as calibration() runs it.
    real = calibrate.measure
    monkeypatch.setattr(calibrate, "measure", lambda: real(quick=True, limits=limits))
    hogs = _busy_neighbours(os.cpu_count() or 1)
    try:
        time.sleep(0.2)
        result = calibrate.calibration(recalibrate=True)
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    assert result["settled"] is False
    assert any("other processes used" in p for p in result["problems"]), result["problems"]
    # Their CPU time shows in every window: before, during and after.
    assert result["load"]["before"] > limits.max_foreign_share
    assert result["load"]["during"] > limits.max_foreign_share
    assert any(r["foreign_share"] > limits.max_foreign_share for r in result["readings"])
    assert not cache.exists()


def test_the_cpu_profile_prices_linears_by_the_measured_curve():
    from llmsched.executor.sim.cost_model import BatchShape, CostModel
    from llmsched.executor.sim.model_shapes import load_model

    curves = {"gemm": [[1, 0.1], [2048, 1.0]], "attention": [[128.5, 0.5]]}
    fast_memory = {"mem_bandwidth": 1e14, "memory_efficiency": 1.0}
    c = dict(FAKE, **fast_memory, attention_efficiency=0.5, efficiency_curves=curves)
    cm = CostModel(load_model("llama-3-8b"), calibrate.profile_from_calibration(c))
    one = {op.name: op for op in cm.ops(BatchShape.from_chunks([(0, 1)], num_sampled=1))}["mlp"]
    big = {op.name: op for op in cm.ops(BatchShape.from_chunks([(0, 2048)], num_sampled=1))}["mlp"]
    # A one-row step's linears at a tenth of the peak, a 2048-row prefill's at all of it.
    assert one.seconds == pytest.approx(one.flops / (0.1 * FAKE["peak_flops"]), rel=1e-9)
    assert big.seconds == pytest.approx(big.flops / FAKE["peak_flops"], rel=1e-9)
