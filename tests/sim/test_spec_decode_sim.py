"""Speculative decoding in the simulator: drafts verified and rolled back by the real scheduler, priced."""

from __future__ import annotations

import pytest

from llmsched.core.errors import ConfigError
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.runner import simulate
from llmsched.sim.workload import synthetic_workload

K = 3


def run(spec: dict | None, acceptance: str | None = None, async_scheduling: bool = False, seed: int = 0):
    if spec is not None:
        spec = {**spec, "seed": seed}
    dep = build_deployment(
        DeploymentSpec(
            model="llama-3-8b",
            hardware="h100",
            speculative_config=spec,
            spec_acceptance=acceptance,
            async_scheduling=async_scheduling,
        )
    )
    return simulate(dep, synthetic_workload(32, 256, 96, seed=1))


NGRAM = {"method": "ngram", "num_speculative_tokens": K}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_full_acceptance_cuts_steps_and_none_costs_time(async_scheduling: bool) -> None:
    off = run(None, async_scheduling=async_scheduling)
    full = run(NGRAM, "1.0", async_scheduling)
    none = run(NGRAM, "0", async_scheduling)
    out = off.summary["total_output_tokens"]
    assert out == 32 * 96
    assert full.summary["total_output_tokens"] == none.summary["total_output_tokens"] == out
    # One prefill step, then 96 - 1 decode tokens in steps of 1 + K.
    assert off.num_busy_steps / full.num_busy_steps == pytest.approx(1 + K, rel=0.1)
    assert full.sim_duration_s < off.sim_duration_s / 2
    assert full.spec_decode["acceptance_rate"] == 1.0
    assert full.spec_decode["mean_acceptance_length"] == 1 + K
    # Nothing accepted: as many steps as without drafts, each dearer.
    assert none.num_busy_steps == off.num_busy_steps
    assert none.sim_duration_s > off.sim_duration_s
    assert none.spec_decode["acceptance_rate"] == 0.0
    assert off.spec_decode is None


def test_per_position_rates_reproduce_with_a_seed() -> None:
    spec = {**NGRAM, "acceptance_rates": [0.9, 0.5, 0.2]}
    a, b, c = run(spec), run(spec), run(spec, seed=7)
    assert a.spec_decode == b.spec_decode and a.sim_duration_s == b.sim_duration_s
    assert c.spec_decode != a.spec_decode
    sd = a.spec_decode
    # Position i is accepted with probability 0.9 x 0.5 x ... (the chain up to it).
    drafts = sd["num_drafts"]
    expected = [0.9, 0.45, 0.09]
    for got, want in zip(sd["accepted_per_position"], expected):
        assert got / drafts == pytest.approx(want, abs=0.05)
    assert sd["mean_acceptance_length"] == pytest.approx(1 + sum(expected), abs=0.1)


def test_draft_model_is_priced_and_takes_memory() -> None:
    plain = build_deployment(DeploymentSpec(model="llama-3-8b", hardware="h100"))
    spec = {"model": "llama-3.2-1b", "num_speculative_tokens": K, "acceptance_rate": 0.0}
    dep = build_deployment(DeploymentSpec(model="llama-3-8b", hardware="h100", speculative_config=spec))
    assert dep.scheduler_config.num_lookahead_tokens == K
    assert dep.memory.num_gpu_blocks < plain.memory.num_gpu_blocks
    ngram = run(NGRAM, "0")
    draft = run({k: v for k, v in spec.items() if k != "acceptance_rate"}, "0")
    # The same steps; the draft model's K forwards make each dearer than lookup.
    assert draft.num_busy_steps == ngram.num_busy_steps
    assert draft.sim_duration_s > ngram.sim_duration_s
    assert "draft model llama-3.2-1b" in "\n".join(dep.describe())


def test_bad_configs_are_named() -> None:
    with pytest.raises(ConfigError, match="acceptance model"):
        run(NGRAM)
    with pytest.raises(ConfigError, match="must be a number in"):
        run(NGRAM, "1.5")
    with pytest.raises(ConfigError, match="unknown model"):
        run({"model": "no-such-model", "num_speculative_tokens": 2}, "0.5")
    with pytest.raises(ConfigError, match="needs --speculative-config"):
        run(None, "0.5")
