"""Hardware profiles: the built-ins, JSON profiles, and errors that list the known names."""

from __future__ import annotations

import json

import pytest

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.hardware import BUILTIN_HARDWARE, GiB, known_hardware, load_hardware


def test_required_profiles_exist():
    assert {"h100", "h200", "a100", "b200", "cpu"} <= set(known_hardware())


def test_h100_figures():
    h = load_hardware("h100")
    assert h.peak_flops_bf16 == pytest.approx(989.4e12)
    assert h.gemm_peak(fp8=True) == pytest.approx(2 * h.peak_flops_bf16, rel=0.01)
    assert h.mem_bandwidth == pytest.approx(3.35e12)
    assert 79 * GiB < h.mem_capacity < 80 * GiB
    assert load_hardware("H100-SXM") is h


def test_generations_are_ordered():
    a, h, h2, b = (BUILTIN_HARDWARE[k] for k in ("a100", "h100", "h200", "b200"))
    assert a.mem_bandwidth < h.mem_bandwidth < h2.mem_bandwidth < b.mem_bandwidth
    assert h2.mem_capacity > h.mem_capacity
    assert a.peak_flops_bf16 < h.peak_flops_bf16 < b.peak_flops_bf16


def test_fp8_weights_on_a100_run_at_bf16_rate():
    a = load_hardware("a100")
    assert a.peak_flops_fp8 is None
    assert a.gemm_peak(fp8=True) == a.peak_flops_bf16


def test_unknown_name_lists_known_ones():
    with pytest.raises(ConfigError) as e:
        load_hardware("tpu-v9")
    for name in ("a100", "b200", "cpu", "h100", "h200"):
        assert name in str(e.value)


def test_cpu_is_left_to_the_simulator_that_measures_it():
    # The cost model only prices steps: measuring this machine is llmsched.sim's calibration.
    with pytest.raises(ConfigError, match=r"llmsched\.sim\.load_hardware"):
        load_hardware("cpu")


def test_json_profile(tmp_path):
    p = tmp_path / "mygpu.json"
    p.write_text(
        json.dumps(
            {
                "peak_flops_bf16": 1e15,
                "mem_bandwidth": 5e12,
                "mem_capacity": 96 * GiB,
                "link_bandwidth": 4e11,
                "collective_latency_s": 1e-5,
            }
        )
    )
    h = load_hardware(str(p))
    assert h.name == "mygpu"
    assert h.mem_bandwidth == 5e12
    assert h.peak_flops_fp8 is None
    assert h.kernel_launch_s == 0.0


def test_json_profile_errors_name_the_field(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"peak_flops_bf16": 1e15}))
    with pytest.raises(ConfigError, match="missing hardware fields"):
        load_hardware(str(p))
    p.write_text(json.dumps({"peak_flops_bf16": 1e15, "warp_speed": 9}))
    with pytest.raises(ConfigError, match="warp_speed"):
        load_hardware(str(p))
    full = {
        "peak_flops_bf16": 1e15,
        "mem_bandwidth": 5e12,
        "mem_capacity": 2**36,
        "link_bandwidth": 4e11,
        "collective_latency_s": 1e-5,
    }
    p.write_text(json.dumps({**full, "kernel_launch_s": -1e-6}))
    with pytest.raises(ConfigError, match="kernel_launch_s"):
        load_hardware(str(p))
    p.write_text(json.dumps({**full, "kernel_launch_s": 4e-6}))
    assert load_hardware(str(p)).kernel_launch_s == 4e-6


def test_gpus_launch_kernels_at_a_few_microseconds():
    for name in ("a100", "h100", "h200", "b200"):
        assert BUILTIN_HARDWARE[name].kernel_launch_s == 5e-6, name


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("host_overlaps_model", "no"),
        ("layer_overhead_covers_tokens", -1),
        ("layer_overhead_covers_tokens", 1.5),
    ],
)
def test_a_profile_file_with_a_bad_host_field_names_it(tmp_path, field, value):
    data = dict(BUILTIN_HARDWARE["h100"].to_dict(), **{field: value})
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=field):
        load_hardware(str(path))


@pytest.mark.parametrize(
    ("curves", "complaint"),
    [
        ([[1, 0.5]], "must be an object"),
        ({"mlp": [[1, 0.5]]}, r"kinds \['mlp'\] unknown"),
        ({"gemm": []}, "non-empty list"),
        ({"gemm": [[1, 0.5, 2]]}, "non-empty list"),
        ({"gemm": [[64, 0.5], [16, 0.7]]}, "positive and increasing"),
        ({"gemm": [[0, 0.5]]}, "positive and increasing"),
        ({"attention": [[128, 1.3]]}, r"in \(0, 1\]"),
    ],
)
def test_a_bad_efficiency_curve_is_named(tmp_path, curves, complaint):
    data = dict(BUILTIN_HARDWARE["h100"].to_dict(), kernel_fit=None, efficiency_curves=curves)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=f"efficiency_curves.*{complaint}|{complaint}"):
        load_hardware(str(path))


def test_efficiency_curves_round_trip_through_a_profile_file(tmp_path):
    curves = {"gemm": [[1, 0.05], [64, 0.7], [2048, 0.95]], "attention": [[128.5, 0.4], [2048.5, 0.7]]}
    data = dict(BUILTIN_HARDWARE["h100"].to_dict(), kernel_fit=None, efficiency_curves=curves)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    assert load_hardware(str(path)).efficiency_curves == curves
