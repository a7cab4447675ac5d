"""Sweeps: parsing and checking the file, the front and the cheapest point, pool and Ray agree."""

from __future__ import annotations

import json
import time

import pytest

from llmsched.cli import main
from llmsched.core.errors import ConfigError
from llmsched.sim.sweep import Sweep, cheapest, load_sweep, pareto_front, parse_sweep, run_sweep

TINY = {"num_prompts": 12, "input_len": 64, "output_len": 8, "request_rate": 50.0}


def grid_200() -> dict:
    """2 x 2 x 2 x 5 x 5 = 200 points on a tiny workload."""
    return {
        "slo": {"p99_ttft_ms": 30},
        "gpu_cost": {"h100": 2.0, "a100": 1.0},
        "workload": TINY,
        "grid": {
            "hardware": ["h100", "a100"],
            "tensor_parallel_size": [1, 2],
            "data_parallel_size": [1, 2],
            "max_num_seqs": [2, 4, 8, 16, 64],
            "max_num_batched_tokens": [64, 128, 256, 1024, 8192],
        },
    }


def without_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"grid": {}}, "slo.p99_ttft_ms is required"),
        ({"slo": {"p99_ttft_ms": 1}, "grid": {"max_num_seq": [1]}}, "unknown key(s) max_num_seq"),
        (
            {"slo": {"p99_ttft_ms": 1}, "grid": {"max_num_seqs": 4}},
            "grid.max_num_seqs must be a non-empty list",
        ),
        ({"slo": {"p99_ttft_ms": 1}, "search": "bayes"}, "search 'bayes' is unknown"),
        ({"slo": {"p99_ttft_ms": 1}, "search": "random"}, "random search needs samples"),
        ({"slo": {"p99_ttft_ms": 1}, "workload": {"rate": 3}}, "workload: unknown key(s) rate"),
        ({"slo": {"p99_ttft_ms": 1}, "budget": 3}, "unknown key(s) budget"),
    ],
)
def test_a_bad_sweep_is_refused_by_name(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_sweep(data)


def test_grid_and_random_search_expand_the_knobs():
    data = grid_200()
    assert len(parse_sweep(data).points) == 200
    a = parse_sweep({**data, "search": "random", "samples": 7, "seed": 3}).points
    b = parse_sweep({**data, "search": "random", "samples": 7, "seed": 3}).points
    assert a == b and len(a) == 7 and len({json.dumps(p, sort_keys=True) for p in a}) == 7
    assert all(p in parse_sweep(data).points for p in a)


def row(point, gpus, tput, ttft, meets=True, cost=None):
    return {
        "point": point,
        "config": {},
        "gpus": gpus,
        "completed": 1,
        "throughput_per_gpu": tput,
        "p99_ttft_ms": ttft,
        "meets_slo": meets,
        "cost": gpus if cost is None else cost,
    }


def test_pareto_front_and_cheapest_point():
    rows = [row(0, 1, 100, 50), row(1, 2, 300, 80), row(2, 1, 90, 60), row(3, 4, 500, 200, meets=False)]
    assert [r["point"] for r in pareto_front(rows)] == [0, 1, 3]
    assert cheapest(rows)["point"] == 0
    assert cheapest([r for r in rows if r["point"] != 0])["point"] == 2
    assert cheapest([rows[3]]) is None


def test_a_point_that_cannot_run_says_why():
    sweep = parse_sweep(
        {"slo": {"p99_ttft_ms": 100}, "workload": TINY, "grid": {"hardware": ["h100", "tpu9"]}}
    )
    rows = run_sweep(sweep, workers=1)
    assert "error" not in rows[0] and rows[0]["meets_slo"] in (True, False)
    assert "tpu9" in rows[1]["error"] and rows[1]["meets_slo"] is False and rows[1]["cost"] is None


def test_data_parallel_policies_and_api_servers_are_knobs_too():
    from llmsched.engine.dp.config import DPConfig
    from llmsched.sim.deployment import DeploymentSpec, build_deployment
    from llmsched.sim.frontend import Frontend
    from llmsched.sim.runner import simulate
    from llmsched.sim.workload import synthetic_workload

    workload = {"num_prompts": 48, "input_len": 256, "output_len": 24, "range_ratio": 0.5, "seed": 1}
    sweep = parse_sweep(
        {
            "slo": {"p99_ttft_ms": 1000},
            "workload": workload,
            "deployment": {"model": "qwen3-30b-a3b", "max_num_seqs": 4, "api_server_count": 1},
            "grid": {"data_parallel_size": [1, 2], "balance_scheduling": [False, True]},
        }
    )
    rows = run_sweep(sweep, workers=1)
    # One engine has no ranks to balance: that point says so instead of running.
    assert "error" not in rows[0]
    assert "need data_parallel_size > 1" in rows[1]["error"]
    # Each point is the simulation its knobs name.
    dep = build_deployment(DeploymentSpec(model="qwen3-30b-a3b", max_num_seqs=4, data_parallel_size=2))
    wl = synthetic_workload(48, 256, 24, range_ratio=0.5, seed=1)
    for r, balance in ((rows[2], False), (rows[3], True)):
        direct = simulate(dep, wl, dp=DPConfig(2, balance_scheduling=balance), frontend=Frontend(1))
        assert r["output_throughput"] == direct.summary["output_throughput"]
        assert r["p99_ttft_ms"] == direct.summary["p99_ttft_ms"]
    assert rows[2]["output_throughput"] != rows[3]["output_throughput"]


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (
            {"data_parallel_size": 2, "balance_scheduling": "yes"},
            "balance_scheduling='yes' must be true or false",
        ),
        ({"data_parallel_size": 2, "prefill_schedule_interval": 0}, "prefill_schedule_interval=0"),
        ({"api_server_count": 0}, "api_server_count=0"),
        ({"balance_scheduling": True}, "need data_parallel_size > 1"),
    ],
)
def test_bad_run_knobs_are_listed_with_the_reason(knobs, message):
    sweep = parse_sweep(
        {"slo": {"p99_ttft_ms": 100}, "workload": TINY, "deployment": {"model": "qwen3-30b-a3b", **knobs}}
    )
    (row,) = run_sweep(sweep, workers=1)
    assert message in row["error"] and row["meets_slo"] is False


@pytest.mark.slow
def test_two_hundred_points_give_the_same_table_on_a_process_pool_and_a_local_ray_cluster():
    pytest.importorskip("ray")
    sweep = parse_sweep(grid_200())
    t0 = time.perf_counter()
    pool = run_sweep(sweep, workers=2)
    t_pool = time.perf_counter() - t0
    t0 = time.perf_counter()
    on_ray = run_sweep(sweep, ray_address="local")
    t_ray = time.perf_counter() - t0
    print(f"200 points: process pool {t_pool:.1f} s, local Ray cluster {t_ray:.1f} s (startup included)")
    assert len(pool) == 200
    assert without_wall(pool) == without_wall(on_ray)
    # The sweep judges something: some points miss the SLO, some meet it, some do not fit.
    assert any(r["meets_slo"] for r in pool) and any(not r["meets_slo"] for r in pool)
    assert cheapest(pool) is not None and len(pareto_front(pool)) >= 1


def test_simulate_sweep_writes_the_table_json_and_plot(tmp_path, capsys):
    data = grid_200()
    data["grid"] = {"max_num_seqs": [2, 64], "tensor_parallel_size": [1, 2]}
    path = tmp_path / "sweep.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "res.json"
    assert main(["simulate", "--sweep", str(path), "--sweep-workers", "1", "--result-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Pareto front" in text and ("Cheapest meeting" in text or "No configuration meets" in text)
    res = json.loads(out.read_text())
    assert len(res["points"]) == 4 and res["backend"] == "process pool"
    assert isinstance(load_sweep(path), Sweep)


def test_ray_address_without_a_sweep_is_refused(capsys):
    assert main(["simulate", "--ray-address", "auto", "--num-prompts", "1"]) != 0
    assert "--ray-address runs a sweep" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "num_points"), [("sweep.yaml", 108), ("sweep_dp.yaml", 12)])
def test_the_example_sweeps_parse(name, num_points):
    from pathlib import Path

    pytest.importorskip("yaml")
    path = Path(__file__).resolve().parents[2] / "examples" / name
    assert len(load_sweep(path).points) == num_points
