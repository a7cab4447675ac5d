"""Named profile files: written by `llmsched calibrate`, loaded by `--hardware FILE`, compared."""

from __future__ import annotations

import json
import logging

import pytest

from llmsched.cli import main
from llmsched.core.errors import ConfigError
from llmsched.executor.sim.hardware import load_hardware
from llmsched.sim import calibrate
from llmsched.sim.profile_file import FORMAT, compare, read_calibration, write_profile

CAL = {
    "backend": "torch",
    "peak_flops": 420e9,
    "mem_bandwidth": 40e9,
    "memory_efficiency": 0.5,
    "attention_efficiency": 0.25,
    "decode_kv_bandwidth": 12e9,
    "step_overhead_s": 7e-4,
    "layer_overhead_s": 6e-4,
    "request_overhead_s": 3e-5,
    "mem_capacity": 64.0 * 2**30,
    "seconds": 9.0,
    "measured_at": "now",
    "settled": True,
    "problems": [],
    "readings": [
        {
            "name": "peak_flops",
            "value": 420e9,
            "spread": 0.02,
            "calls": 9,
            "settled": True,
            "foreign_share": 0.01,
            "attempts": 1,
            "readings": 3,
        }
    ],
    "load": {"before": 0.0, "during": 0.01, "after": 0.0, "busiest_others": []},
    "machine": {"node": "here", "torch": "2.13.0"},
}


def test_a_written_profile_loads_as_the_same_hardware(tmp_path):
    path = tmp_path / "mybox.json"
    hw = write_profile(path, CAL)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT
    assert data["calibration"]["machine"]["torch"] == "2.13.0"
    loaded = load_hardware(str(path))
    assert loaded == hw
    assert loaded.name == "mybox"
    assert loaded.peak_flops_bf16 == 420e9
    assert loaded.decode_kv_bandwidth == 12e9
    assert loaded.efficiency == {"attention": 0.25, "memory": 0.5}
    assert read_calibration(path)["readings"][0]["spread"] == 0.02


def test_an_unsettled_profile_warns_when_loaded(tmp_path, caplog):
    path = tmp_path / "busy.json"
    write_profile(path, dict(CAL, settled=False, problems=["peak_flops: other processes used 50%"]))
    with caplog.at_level(logging.WARNING):
        hw = load_hardware(str(path))
    assert "UNSETTLED" in hw.description
    assert "other processes used 50%" in caplog.text


def test_compare_gives_each_fitted_figures_difference():
    rows = {k: rel for k, _, _, rel in compare(CAL, dict(CAL, peak_flops=441e9, step_overhead_s=None))}
    assert rows["peak_flops"] == pytest.approx(0.05)
    assert rows["mem_bandwidth"] == 0.0
    assert "step_overhead_s" not in rows


def test_read_calibration_names_a_file_that_is_not_a_profile(tmp_path):
    path = tmp_path / "bare.json"
    path.write_text(json.dumps({"peak_flops_bf16": 1.0}))
    with pytest.raises(ConfigError, match="not a calibrated profile file"):
        read_calibration(path)


def test_calibrate_cli_writes_a_settled_profile_and_compares(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "calibration", lambda recalibrate=False: dict(CAL))
    first = tmp_path / "a.json"
    assert main(["calibrate", "-o", str(first)]) == 0
    assert load_hardware(str(first)).name == "a"
    monkeypatch.setattr(calibrate, "calibration", lambda recalibrate=False: dict(CAL, peak_flops=210e9))
    second = tmp_path / "b.json"
    assert main(["calibrate", "-o", str(second), "--compare", str(first)]) == 0
    out = capsys.readouterr().out
    assert "peak_flops" in out and "-50.0%  > 5%" in out


def test_calibrate_cli_refuses_an_unsettled_calibration(tmp_path, monkeypatch, capsys):
    bad = dict(CAL, settled=False, problems=["before measuring: other processes used 98% of the cores"])
    monkeypatch.setattr(calibrate, "calibration", lambda recalibrate=False: bad)
    path = tmp_path / "p.json"
    assert main(["calibrate", "-o", str(path)]) == 1
    assert not path.exists()
    assert "other processes used 98%" in capsys.readouterr().out
    assert main(["calibrate", "-o", str(path), "--keep-unsettled"]) == 1
    assert json.loads(path.read_text())["calibration"]["settled"] is False


def test_simulate_runs_on_a_profile_file(tmp_path, capsys):
    path = tmp_path / "box.json"
    write_profile(path, CAL)
    argv = ["simulate", "--model", "llama-3-8b", "--hardware", str(path), "--num-prompts", "4"]
    assert main([*argv, "--input-len", "64", "--output-len", "8", "--disable-tqdm"]) == 0
    assert "420.0 GFLOP/s" in capsys.readouterr().out


def test_calibrate_help_names_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--keep-unsettled" in out and "--compare" in out and "5% is flagged" in out
