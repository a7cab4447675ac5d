"""PNG figures of a simulation."""

from __future__ import annotations

import pytest

from llmsched.core import SchedulerConfig
from llmsched.core.errors import ConfigError
from llmsched.executor.sim.cost_model import ConstantCostModel
from llmsched.sim.plots import _binned, write_plots
from llmsched.sim.runner import simulate
from llmsched.sim.workload import synthetic_workload


def test_writes_three_pngs(tmp_path):
    cfg = SchedulerConfig(num_gpu_blocks=300, max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8)
    res = simulate(
        cfg, synthetic_workload(40, 100, 8, request_rate=20.0), ConstantCostModel(0.02), record_series=True
    )
    paths = write_plots(res, tmp_path / "out" / "run")
    assert [p.name for p in paths] == ["run_timeline.png", "run_tokens.png", "run_latency_cdf.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_needs_the_series(tmp_path):
    cfg = SchedulerConfig(num_gpu_blocks=300, max_model_len=512)
    res = simulate(cfg, synthetic_workload(2, 10, 2), ConstantCostModel(0.02))
    with pytest.raises(ConfigError, match="record_series"):
        write_plots(res, tmp_path / "x")


def test_binning_averages():
    xs, ys = _binned(list(range(10)), [1, 1, 3, 3, 5, 5, 7, 7, 9, 9], max_points=5)
    assert xs == [0, 2, 4, 6, 8] and ys == [1, 3, 5, 7, 9]
    assert _binned([1, 2], [3, 4]) == ([1, 2], [3, 4])
