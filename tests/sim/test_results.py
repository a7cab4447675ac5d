"""Per-request lists (--save-detailed) are in dataset order under every policy and deployment."""

from __future__ import annotations

import json
from array import array
from dataclasses import replace
from pathlib import Path

import pytest

from llmsched.cli import main
from llmsched.core import SchedulerConfig
from llmsched.engine.dp import DPConfig
from llmsched.executor.sim.cost_model import ConstantCostModel
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.pd import PDConfig, simulate_pd
from llmsched.sim.runner import simulate
from llmsched.sim.sessions import SessionWorkload, simulate_sessions
from llmsched.sim.workload import Workload, load_trace_workload

# The file lists requests out of arrival order; each has its own prompt length (its key below).
N = 24


def lines() -> list[dict]:
    """Tenant a's 16 requests arrive first, b's 8 just after; outputs of different lengths."""
    out = []
    for i in range(N):
        j = (i * 5) % N  # file line i holds the j-th arrival
        out.append({
            "arrival_time": 0.0 if j < 16 else 0.001 * (j - 15),
            "prompt_len": 40 + 3 * j,
            "output_len": 4 + (j * 7) % 13,
            "tenant": "a" if j < 16 else "b",
        })  # fmt: skip
    return out


def dataset(tmp_path: Path) -> Path:
    p = tmp_path / "tenants.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines()))
    return p


def assert_in_dataset_order(summary: dict, records: list[tuple]) -> None:
    """Each list entry is the figure of the request on that dataset line (records keyed by prompt length)."""
    by_prompt = {r[4]: r for r in records}
    assert len(by_prompt) == N
    assert summary["input_lens"] == [x["prompt_len"] for x in lines()]
    assert summary["output_lens"] == [x["output_len"] for x in lines()]
    for k, x in enumerate(lines()):
        _, sent, first, end, _, _ = by_prompt[x["prompt_len"]]
        assert summary["start_times"][k] == sent
        assert summary["ttfts"][k] == pytest.approx(first - sent)
        assert summary["latencies"][k] == pytest.approx(end - sent)
    assert summary["errors"] == [""] * N


def finish_order(records: list[tuple]) -> list[int]:
    return [r[4] for r in sorted(records, key=lambda r: r[3])]


def test_fair_policy_writes_lists_in_dataset_order(tmp_path: Path) -> None:
    wl = load_trace_workload(dataset(tmp_path))
    cfg = SchedulerConfig(num_gpu_blocks=256, max_model_len=512, max_num_seqs=2, policy="fair")
    for async_scheduling in (False, True):
        res = simulate(
            replace(cfg, async_scheduling=async_scheduling),
            wl,
            ConstantCostModel(0.01),
            detailed=True,
            record_requests=True,
        )
        # The case that matters: requests finish out of dataset (and arrival) order.
        assert finish_order(res.requests) != [x["prompt_len"] for x in lines()]
        assert finish_order(res.requests) != sorted(x["prompt_len"] for x in lines())
        assert_in_dataset_order(res.summary, res.requests)


def test_data_parallel_writes_lists_in_dataset_order(tmp_path: Path) -> None:
    wl = load_trace_workload(dataset(tmp_path))
    dep = build_deployment(DeploymentSpec(data_parallel_size=2, max_num_seqs=3, scheduling_policy="fair"))
    res = simulate(dep, wl, dp=DPConfig(2, lockstep=False), detailed=True, record_requests=True)
    assert finish_order(res.requests) != sorted(x["prompt_len"] for x in lines())
    assert_in_dataset_order(res.summary, res.requests)


def test_failed_requests_keep_their_place(tmp_path: Path) -> None:
    # An 80-token limit refuses the long prompts; vLLM writes a failure as zeros and its error.
    wl = load_trace_workload(dataset(tmp_path))
    cfg = SchedulerConfig(num_gpu_blocks=256, max_model_len=80, max_num_seqs=2, policy="fair")
    res = simulate(cfg, wl, ConstantCostModel(0.01), detailed=True)
    s = res.summary
    assert 0 < s["failed"] < N
    assert s["input_lens"] == [x["prompt_len"] for x in lines()]
    for k, x in enumerate(lines()):
        fits = x["prompt_len"] < 80
        assert (s["errors"][k] == "") == fits, k
        if not fits:
            assert "max_model_len" in s["errors"][k]
            assert s["output_lens"][k] == 0 and s["ttfts"][k] == 0.0 and s["latencies"][k] == 0.0
        else:
            assert 0 < s["output_lens"][k] <= x["output_len"] and s["ttfts"][k] > 0


def test_pd_writes_lists_in_dataset_order() -> None:
    # All at once: the one long output finishes last although it is the first line.
    outs = [200] + [2] * 11
    wl = Workload(
        arrivals=array("d", [0.0] * 12),
        input_lens=array("l", [300 + 10 * i for i in range(12)]),
        output_lens=array("l", outs),
    )
    dep = build_deployment(DeploymentSpec(model="llama-3-8b", hardware="h100"))
    for pd in (PDConfig(1, 1), PDConfig(0, 2)):
        s = simulate_pd(dep, wl, pd, detailed=True).summary
        assert s["input_lens"] == list(wl.input_lens)
        assert s["output_lens"] == outs
        assert s["latencies"][0] == max(s["latencies"])
        assert all(0 < t < e for t, e in zip(s["ttfts"], s["latencies"]))
        assert s["errors"] == [""] * 12


def test_sessions_list_turns_in_conversation_order() -> None:
    dep = build_deployment(DeploymentSpec(model="llama-3-8b", hardware="h100"))
    wl = SessionWorkload(
        num_sessions=6, turns=2, first_input_len=400, input_len=50, output_len=8, think_time_s=0.05, seed=3
    )
    res = simulate_sessions(dep, wl, "session")
    assert res.conversations == [list(range(6))] * 2
    lists = res.per_turn_lists()
    assert lists["ttfts_per_turn"] == res.ttft_s
    assert lists["latencies_per_turn"] == res.e2el_s
    # Conversation 0 is sent first and waits for nobody: its first turn has the smallest TTFT.
    assert res.ttft_s[0][0] == min(res.ttft_s[0])


def test_cli_save_detailed_zips_with_the_dataset(tmp_path: Path, capsys) -> None:
    rj = tmp_path / "r.json"
    code = main([
        "simulate", "--disable-tqdm", "--dataset", str(dataset(tmp_path)), "--scheduling-policy", "fair",
        "--max-num-seqs", "2", "--save-detailed", "--result-json", str(rj),
    ])  # fmt: skip
    capsys.readouterr()
    assert code == 0
    data = json.loads(rj.read_text())
    assert data["input_lens"] == [x["prompt_len"] for x in lines()]
    assert data["output_lens"] == [x["output_len"] for x in lines()]
    assert data["errors"] == [""] * N


def test_step_costs_add_serial_sums_as_one_step_at_a_time() -> None:
    # The bulk adder must give the very floats that adding each step gives
    # (summation order changes the last bits, and results must not move).
    from llmsched.executor.sim.executor import StepTiming
    from llmsched.sim.results import StepCosts

    # Steps far below the running total's last bit vanish one by one but
    # not once summed among themselves.
    hosts = array("d", [6e-17, 6e-17, 3.3e-4, 6e-17, 2.5e-6] * 7)
    models = array("d", [7.1e-3, 0.2, 1e-12, 5.5e-3, 0.03] * 7)
    bulk, one = StepCosts(), StepCosts()
    bulk.host_s = one.host_s = bulk.host_gap_s = one.host_gap_s = 1.0
    bulk.add_serial(hosts[:4], models[:4])
    bulk.add_serial(hosts[4:], models[4:])
    for h, m in zip(hosts, models):
        one.add(StepTiming(host=h, model=m, host_gap=h))
    assert (bulk.host_s, bulk.model_s, bulk.host_gap_s) == (one.host_s, one.model_s, one.host_gap_s)
    assert bulk.num_steps == one.num_steps == len(hosts)
    assert bulk.host_gaps == one.host_gaps
    with pytest.raises(ValueError, match="3 host paths for 2 model times"):
        bulk.add_serial(hosts[:3], models[:2])
