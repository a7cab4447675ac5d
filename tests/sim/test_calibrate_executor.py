"""The executor probe: the fit recovers known host costs, and the probe runs on the real executor."""

from __future__ import annotations

import math

import pytest

from llmsched.executor.sim.hardware import HardwareProfile
from llmsched.sim import calibrate_executor as ce
from llmsched.sim.calibrate_executor import StepSample, fit_host_costs

STEP, LAYER, REQUEST, RATE = 2e-3, 3e-4, 2e-5, 6e9


def synthetic(step: float = STEP, layer: float = LAYER, request: float = REQUEST, rate: float = RATE):
    out = []
    for layers in (1, 4):
        for decodes in (1, 32):
            for context in (32, 512):
                kv = layers * decodes * context * 1024.0
                t = step + layers * layer + decodes * request + kv / rate
                out.append(StepSample(layers, decodes, kv, t))
    return out


def test_fit_recovers_known_costs():
    fit = fit_host_costs(synthetic())
    assert fit.step_overhead_s == pytest.approx(STEP, rel=1e-6)
    assert fit.layer_overhead_s == pytest.approx(LAYER, rel=1e-6)
    assert fit.request_overhead_s == pytest.approx(REQUEST, rel=1e-6)
    assert fit.decode_kv_bandwidth == pytest.approx(RATE, rel=1e-6)


def test_a_term_the_data_pushes_below_zero_is_dropped_not_negative():
    samples = synthetic(request=0.0)
    # Noise that makes the big batches look slightly cheaper per request.
    noisy = [StepSample(s.layers, s.decodes, s.kv_bytes, s.residual_s - (2e-6 * s.decodes)) for s in samples]
    fit = fit_host_costs(noisy)
    assert fit.request_overhead_s == 0.0
    assert min(fit.step_overhead_s, fit.layer_overhead_s) >= 0.0
    assert fit.decode_kv_bandwidth > 0.0


def test_no_kv_dependence_means_an_unbounded_rate():
    fit = fit_host_costs(synthetic(rate=math.inf))
    # Rounding may leave a vanishing per-byte cost: reading the KV is free.
    assert fit.decode_kv_bandwidth > 1e20
    assert fit.step_overhead_s == pytest.approx(STEP, rel=1e-6)


def test_probe_runs_on_the_torch_executor(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    monkeypatch.setattr(ce, "PROBE_BATCHES", ((1, 16), (4, 48)))
    monkeypatch.setattr(ce, "PROBE_STEPS", 2)
    monkeypatch.setattr(ce, "PROBE_PASSES", 1)
    hw = HardwareProfile(
        name="probe",
        description="",
        peak_flops_bf16=1e11,
        peak_flops_fp8=None,
        mem_bandwidth=1e10,
        mem_capacity=1e10,
        link_bandwidth=1e10,
        collective_latency_s=0.0,
        cuda_graphs=False,
    )
    folder = tmp_path / "probe"
    ce.write_probe_model(folder, 2)
    samples = ce.time_decode_steps(folder, 2, hw)
    assert [(s.layers, s.decodes) for s in samples] == [(2, 1), (2, 4)]
    # Four requests read more cached KV than one with a shorter context.
    assert samples[1].kv_bytes > samples[0].kv_bytes > 0
    assert all(math.isfinite(s.residual_s) for s in samples)


def test_fit_error_is_small_on_consistent_steps_and_large_on_disturbed_ones():
    samples = synthetic()
    assert ce.fit_rms_error(fit_host_costs(samples), samples) < 1e-6
    # Two batches slowed threefold by a neighbour: the steps no longer fit one model.
    disturbed = [
        StepSample(s.layers, s.decodes, s.kv_bytes, s.residual_s * (3 if i in (1, 6) else 1))
        for i, s in enumerate(samples)
    ]
    assert ce.fit_rms_error(fit_host_costs(disturbed), disturbed) > 0.3


@pytest.mark.parametrize("bf16_matmuls, expected", [(True, "bfloat16"), (False, "float32")])
def test_the_probe_model_is_written_in_the_dtype_the_executor_runs_here(
    tmp_path, monkeypatch, bf16_matmuls, expected
):
    import json

    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from llmsched.sim import calibrate_torch

    monkeypatch.setattr(calibrate_torch, "cpu_bf16_matmuls", lambda: bf16_matmuls)
    assert calibrate_torch.dtype_name(calibrate_torch.compute_dtype()) == expected
    folder = tmp_path / "probe"
    ce.write_probe_model(folder, 1)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == expected
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert str(f.get_tensor("model.norm.weight").dtype) == f"torch.{expected}"


def test_the_probe_is_priced_in_the_dtype_it_runs_in():
    pytest.importorskip("torch")
    from llmsched.sim.calibrate_executor import probe_shape
    from llmsched.sim.calibrate_torch import compute_dtype

    # KV and weights in the executor's dtype (float32 without bfloat16 units): bfloat16's
    # two bytes halved the fitted decode KV read rate.
    shape = probe_shape(2)
    assert shape.dtype_bytes == shape.weight_bytes == compute_dtype().itemsize
    assert shape.num_layers == 2
