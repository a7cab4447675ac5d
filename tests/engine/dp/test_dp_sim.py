"""The simulated DP deployment: cost model, sizing, the runner and `llmsched simulate -dp`."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace

import pytest

from llmsched.cli import main
from llmsched.core import ConfigError
from llmsched.engine.dp import DPConfig
from llmsched.engine.dp.sim_transport import DUMMY_BATCH, group_launch_mode, group_step_time
from llmsched.executor.sim.cost_model import (
    LAUNCH_EAGER,
    LAUNCH_GRAPH,
    LAUNCH_PIECEWISE,
    BatchShape,
    ConstantCostModel,
    CostModel,
    Parallelism,
)
from llmsched.executor.sim.hardware import load_hardware
from llmsched.executor.sim.model_shapes import load_model
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.runner import simulate
from llmsched.sim.workload import synthetic_workload

DSV3 = load_model("deepseek-v3")
H100 = load_hardware("h100")


def test_expert_layers_see_the_whole_groups_tokens() -> None:
    decode = BatchShape(num_tokens=32, num_sampled=32, num_decodes=32, decode_context=32 * 4000)
    one = CostModel(DSV3, H100, Parallelism(4, True))
    # Without data parallelism the group is the batch: nothing changes.
    assert one.step_time_in_group(decode, 32) == one.step_time(decode)
    dp = CostModel(DSV3, H100, Parallelism(4, True, data_parallel_size=4))
    assert dp.ep == 16
    alone = dp.step_time_in_group(decode, 32)
    beside_a_prefill = dp.step_time_in_group(decode, 32 + 8192)
    # Same local batch, but the experts (and the all-to-all) now serve a prefill's tokens too.
    assert beside_a_prefill > alone * 1.5
    names = {op.name for op in dp.ops(decode, 8224)}
    assert {"moe_experts", "ep_all_to_all"} <= names


def test_a_dp_deployment_spreads_experts_over_all_gpus_and_picks_the_smallest_tp_that_fits() -> None:
    d = build_deployment(
        DeploymentSpec(model="deepseek-v3", hardware="h100", data_parallel_size=4, tensor_parallel_size=None)
    )
    assert (d.cost_model.tp, d.cost_model.ep, d.num_gpus) == (4, 16, 16)
    assert d.tensor_parallel_auto
    text = "\n".join(d.describe())
    assert "16x NVIDIA H100" in text and "DP=4 x TP=4" in text and "EP=16" in text
    assert d.to_dict()["data_parallel_size"] == 4
    # Weights per GPU: the experts split 16 ways, the rest 4 ways.
    assert d.memory.weight_bytes < 50 * 2**30
    with pytest.raises(ConfigError, match="per data-parallel rank, experts over 8 GPUs"):
        build_deployment(
            DeploymentSpec(model="deepseek-v3", hardware="h100", data_parallel_size=4, tensor_parallel_size=2)
        )


def test_one_independent_rank_simulates_exactly_like_the_single_engine_loop() -> None:
    d = build_deployment(DeploymentSpec(model="llama-3-8b", max_num_seqs=16))
    wl = synthetic_workload(60, 300, 40, request_rate=20.0, range_ratio=0.5, seed=1)
    single = simulate(d, wl, hold_back=False).summary
    dp = simulate(d, wl, dp=DPConfig(1, lockstep=False), sync_s=0.0).summary
    for key in ("duration", "completed", "mean_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "output_throughput"):
        assert dp[key] == pytest.approx(single[key], rel=1e-9), key


def test_two_independent_dense_ranks_double_the_throughput_of_one() -> None:
    d = build_deployment(DeploymentSpec(model="llama-3-8b", max_num_seqs=8))
    wl = synthetic_workload(64, 200, 64)
    one = simulate(d, wl, dp=DPConfig(1, lockstep=False)).summary["output_throughput"]
    two = simulate(d, wl, dp=DPConfig(2, lockstep=False)).summary["output_throughput"]
    assert two == pytest.approx(2 * one, rel=0.05)


def dsv3_run(range_ratio: float, balance: bool) -> dict:
    d = build_deployment(
        DeploymentSpec(
            model="deepseek-v3",
            hardware="h100",
            data_parallel_size=4,
            tensor_parallel_size=None,
            max_num_seqs=8,
        )
    )
    wl = synthetic_workload(96, 3500, 300, range_ratio=range_ratio, seed=3)
    return simulate(d, wl, dp=DPConfig(4, lockstep=True, balance_scheduling=balance)).summary


def test_balance_scheduling_cuts_tpot_when_ranks_are_out_of_phase_and_is_moot_when_they_are_not() -> None:
    # Lengths varying +-30% put the ranks' admissions in different steps: the gate lines them up.
    base, bal = dsv3_run(0.3, False), dsv3_run(0.3, True)
    assert bal["mean_tpot_ms"] < 0.9 * base["mean_tpot_ms"]
    assert bal["output_throughput"] > base["output_throughput"]
    # Identical requests sent together keep the ranks in phase: nothing for the gate to fix.
    same_base, same_bal = dsv3_run(0.0, False), dsv3_run(0.0, True)
    assert same_bal["mean_tpot_ms"] == same_base["mean_tpot_ms"]
    assert same_bal["output_throughput"] == same_base["output_throughput"]


def test_simulate_cli_runs_data_parallel_and_writes_its_figures(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "simulate",
            "--model",
            "qwen3-30b-a3b",
            "--data-parallel-size",
            "2",
            "--balance-scheduling",
            "--num-prompts",
            "24",
            "--input-len",
            "256",
            "--output-len",
            "16",
            "--max-num-seqs",
            "4",
            "--disable-tqdm",
            "--result-json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "2 ranks, lock-step" in text and "balance scheduling" in text
    assert "Rank steps held by the balance gate:" in text
    data = json.loads(out.read_text())
    assert data["completed"] == 24
    dp = data["simulation"]["data_parallel"]
    assert dp["data_parallel_size"] == 2 and dp["balance_scheduling"] and dp["mode"] == "lockstep"
    assert [p["requests"] for p in dp["per_rank"]] == [12, 12]
    assert data["deployment"]["expert_parallel_size"] == 2
    assert not math.isnan(data["mean_tpot_ms"])


def test_simulate_cli_rejects_balance_without_data_parallelism(capsys) -> None:
    rc = main(["simulate", "--balance-scheduling", "--num-prompts", "4", "--disable-tqdm"])
    assert rc == 2
    assert "--data-parallel-size > 1" in capsys.readouterr().err


def test_holding_back_unbuilt_requests_changes_nothing() -> None:
    d = build_deployment(DeploymentSpec(model="llama-3-8b", max_num_seqs=4))
    wl = synthetic_workload(300, 64, 8, range_ratio=0.5, seed=2)
    dp = DPConfig(3, lockstep=True, balance_scheduling=True)
    held = simulate(d, wl, dp=dp).summary
    built = simulate(d, wl, dp=dp, hold_back=False).summary
    assert held == built
    assert held["completed"] == 300


def test_the_step_trace_names_each_rank_and_the_balance_gate() -> None:
    d = build_deployment(DeploymentSpec(model="qwen3-30b-a3b", data_parallel_size=2, max_num_seqs=2))
    wl = synthetic_workload(12, 128, 24, range_ratio=0.5, seed=1)
    buf = io.StringIO()
    res = simulate(d, wl, dp=DPConfig(2, lockstep=True, balance_scheduling=True), trace_out=buf, explain=True)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert lines[0]["header"]["data_parallel"]["balance_scheduling"] is True
    recs = lines[1:]
    assert {r["rank"] for r in recs} == {0, 1}
    # One record per rank per group step, both ranks on the same simulated clock.
    assert len(recs) == 2 * res.num_steps
    by_step: dict[int, set[float]] = {}
    for r in recs:
        by_step.setdefault(r["group_step"], set()).add(r["sim_time_s"])
    assert all(len(times) == 1 for times in by_step.values())
    gated = [e for r in recs for e in r.get("why", {}).get("entries", []) if e[2] == "dp_balance_gate"]
    assert gated and all("at max_num_seqs=2" in e[3] for e in gated)


def test_one_ranks_prefill_makes_the_whole_lock_step_launch_eagerly() -> None:
    cm = CostModel(DSV3, H100, Parallelism(4, True, 4), cuda_graph_max_tokens=64)
    decode = BatchShape(num_tokens=32, num_sampled=32, num_decodes=32, decode_context=32 * 4000)
    prefill = BatchShape.from_chunks([(0, 2048)], 1)
    small = BatchShape.from_chunks([(0, 16), *[(4000, 1)] * 16], 17)
    assert group_launch_mode(cm, [decode] * 4) == LAUNCH_GRAPH
    assert group_launch_mode(cm, [decode, decode, decode, DUMMY_BATCH]) == LAUNCH_GRAPH
    assert group_launch_mode(cm, [decode, small, decode, decode]) == LAUNCH_PIECEWISE
    assert group_launch_mode(cm, [decode, small, decode, prefill]) == LAUNCH_EAGER
    assert group_launch_mode(ConstantCostModel(1.0), [decode, prefill]) is None
    # All ranks decoding replay their graphs: no launch term.
    assert group_step_time(cm, [decode] * 4) == pytest.approx(cm.step_time_in_group(decode, 128))
    # Beside a prefill the decode ranks launch eagerly too, and the step lasts as long as
    # the prefill rank's, launched eagerly.
    group = 3 * 32 + 2048
    assert cm.step_time_in_group(decode, group, LAUNCH_EAGER) == pytest.approx(
        cm.step_time_in_group(decode, group, LAUNCH_GRAPH) + cm.eager_launch_s
    )
    mixed = [decode, decode, decode, prefill]
    assert group_step_time(cm, mixed) == pytest.approx(cm.step_time_in_group(prefill, group, LAUNCH_EAGER))


def test_the_dp_run_counts_its_lock_steps_by_launch_mode() -> None:
    d = build_deployment(
        DeploymentSpec(
            model="deepseek-v3",
            hardware="h100",
            data_parallel_size=4,
            tensor_parallel_size=None,
            max_num_seqs=8,
        )
    )
    assert d.cost_model.cuda_graph_max_tokens == 16  # vLLM: 2 x max_num_seqs
    wl = synthetic_workload(64, 1000, 40, range_ratio=0.3, seed=5)
    res = simulate(d, wl, dp=DPConfig(4, lockstep=True))
    modes = res.data_parallel["launch_modes"]
    assert sum(modes.values()) == res.num_busy_steps
    assert modes["eager"] > 0 and modes["graph"] > modes["eager"]
    row = dict(res.data_parallel["rows"])["Group steps graph/piecewise/eager:"]
    assert row == f"{modes['graph']}/{modes['piecewise']}/{modes['eager']}"
    # Without graphs every lock-step launches eagerly: the steps that replayed a graph
    # (most of them) each take the eager launches longer, the others are unchanged.
    no_graphs = build_deployment(replace(d.spec, cuda_graph_max_tokens=0))
    res0 = simulate(no_graphs, wl, dp=DPConfig(4, lockstep=True))
    assert res0.data_parallel["launch_modes"] == {"eager": res0.num_busy_steps, "piecewise": 0, "graph": 0}
    assert res0.num_busy_steps == res.num_busy_steps
    extra_ms = 1e3 * d.cost_model.eager_launch_s
    slower = res0.summary["mean_tpot_ms"] - res.summary["mean_tpot_ms"]
    assert 0.5 * extra_ms < slower < extra_ms
    eager_s, piecewise_s = d.cost_model.eager_launch_s, d.cost_model.piecewise_launch_s
    added = modes["graph"] * eager_s + modes["piecewise"] * (eager_s - piecewise_s)
    assert res0.sim_duration_s - res.sim_duration_s == pytest.approx(added, rel=1e-6)
