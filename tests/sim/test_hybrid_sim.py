"""A hybrid model simulated end to end: the scheduler runs with Mamba state groups on the simulated pool."""

from __future__ import annotations

import pytest

from llmsched.core.errors import ConfigError
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.runner import simulate
from llmsched.sim.workload import synthetic_workload


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_state_blocks_limit_concurrency(async_scheduling: bool) -> None:
    # 10 usable blocks: each request takes one KV block (1000 tokens) and one state block.
    spec = DeploymentSpec(
        model="bamba-9b",
        hardware="h100",
        num_gpu_blocks=11,
        max_model_len=8192,
        async_scheduling=async_scheduling,
    )
    dep = build_deployment(spec)
    assert dep.scheduler_config.mamba and dep.scheduler_config.block_size == 4096
    res = simulate(dep, synthetic_workload(20, 1000, 16))
    assert res.summary["completed"] == 20
    assert res.max_running == 5
    assert "Mamba state" in dep.describe()[2]


def test_long_prompts_chunk_on_block_boundaries() -> None:
    dep = build_deployment(DeploymentSpec(model="bamba-9b", hardware="h100"))
    res = simulate(dep, synthetic_workload(4, 10000, 8))
    assert res.summary["completed"] == 4
    with pytest.raises(ConfigError, match="must be at least 4096"):
        build_deployment(DeploymentSpec(model="bamba-9b", hardware="h100", max_num_batched_tokens=2048))
    # Without prefix caching chunks need not align.
    build_deployment(
        DeploymentSpec(
            model="bamba-9b", hardware="h100", max_num_batched_tokens=2048, enable_prefix_caching=False
        )
    )
