"""LoRA in the simulator: workloads carry adapter ids, max_loras limits each step, the products are priced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmsched.core.errors import ConfigError
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.runner import simulate
from llmsched.sim.workload import load_trace_workload, synthetic_workload


def run(max_loras: int | None, num_loras: int) -> object:
    dep = build_deployment(DeploymentSpec(model="llama-3-8b", hardware="h100", max_loras=max_loras))
    return simulate(dep, synthetic_workload(400, 512, 64, num_loras=num_loras))


def test_adapters_are_priced_and_slot_limited() -> None:
    base = run(None, 0)
    ignored = run(None, 4)  # LoRA off: adapter ids change nothing
    priced = run(4, 4)
    limited = run(2, 4)
    assert ignored.sim_duration_s == base.sim_duration_s
    assert priced.sim_duration_s > base.sim_duration_s
    assert priced.max_running == base.max_running == 400
    # Two adapters at a time: only their requests run together.
    assert limited.max_running == 200
    assert limited.sim_duration_s > priced.sim_duration_s


def test_trace_lora_ids(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    lines = [{"prompt_len": 8, "output_len": 2, "lora_id": k % 3} for k in range(6)]
    p.write_text("\n".join(json.dumps(x) for x in lines))
    assert list(load_trace_workload(p).loras) == [0, 1, 2, 0, 1, 2]
    p.write_text(json.dumps({"prompt_len": 8, "output_len": 2, "lora_id": -1}))
    with pytest.raises(ConfigError, match="lora_id=-1"):
        load_trace_workload(p)
