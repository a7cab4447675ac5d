"""Scheduling policies in the simulator: tenants from a dataset, declines counted as failures."""

from __future__ import annotations

import json
from pathlib import Path

from llmsched.core import SchedulerConfig
from llmsched.executor.sim.cost_model import ConstantCostModel
from llmsched.sim.runner import simulate
from llmsched.sim.workload import load_trace_workload


def dataset(tmp_path: Path) -> Path:
    """20 requests at time 0: 16 from tenant a, 4 from tenant b (sent last)."""
    p = tmp_path / "trace.jsonl"
    lines = [{"arrival_time": 0.0, "prompt_len": 64, "output_len": 16, "tenant": "a"} for _ in range(16)]
    lines += [{"arrival_time": 0.001, "prompt_len": 64, "output_len": 16, "tenant": "b"} for _ in range(4)]
    p.write_text("\n".join(json.dumps(x) for x in lines))
    return p


def config(policy: str, policy_config: dict | None = None) -> SchedulerConfig:
    """One request at a time, so the admission order is the service order."""
    return SchedulerConfig(
        num_gpu_blocks=256, max_model_len=512, max_num_seqs=1, policy=policy, policy_config=policy_config
    )


def test_tenants_from_a_dataset_reach_the_fair_policy(tmp_path: Path) -> None:
    wl = load_trace_workload(dataset(tmp_path))
    assert wl.tenants is not None and wl.tenants.count("b") == 4
    cost = ConstantCostModel(0.01)
    order = {}
    for policy in ("fcfs", "fair"):
        res = simulate(config(policy), wl, cost, record_requests=True, hold_back=False)
        ends = sorted(res.requests, key=lambda r: r[3])
        order[policy] = [r[0] for r in ends]
    assert order["fcfs"][:16] == ["a"] * 16
    # Fair share: b arrives with a's counter (VTC lift, a wins the tie by
    # arrival), then the two alternate.
    assert order["fair"][:9] == ["a", *(["a", "b"] * 4)]


def test_requests_the_slo_policy_declines_count_as_failed(tmp_path: Path) -> None:
    wl = load_trace_workload(dataset(tmp_path))
    res = simulate(config("slo", {"ttft_slo_s": 0.05}), wl, ConstantCostModel(0.01), record_requests=True)
    assert res.num_declined > 0
    assert res.summary["failed"] == res.num_declined
    assert res.summary["completed"] + res.num_declined == len(wl)
