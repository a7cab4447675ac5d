"""Randomised workloads: per-step scheduler invariants hold and every request completes without leaks."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsched.core import (
    ModelRunnerOutput,
    Request,
    RequestRejected,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)


@dataclass
class Spec:
    """One request of a generated workload."""

    rid: str
    prompt: list[int]
    max_tokens: int
    priority: int
    arrival_step: int
    lora_id: int


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Spec], int]:
    """A random config, workload and executor seed (drafts, acceptance)."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 6))
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(12, 64))
    low = max(max_num_seqs, 1 if chunked else max_model_len)
    budget = draw(st.integers(low, max(low, 96)))
    usable_min = -(-max_model_len // block_size)
    num_gpu_blocks = 1 + draw(st.integers(usable_min, usable_min * 2))
    spec = draw(st.sampled_from([0, 0, 2, 3]))
    config = SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 4, 9])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        scheduler_reserve_full_isl=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.05, 0.2])),
        max_loras=draw(st.sampled_from([None, 1, 2])),
        num_speculative_tokens=spec,
        num_lookahead_tokens=draw(st.sampled_from([0, spec])),
        debug=True,
    )
    prefixes = [[100 + 10 * g + j for j in range(24)] for g in range(3)]
    specs = []
    for k in range(draw(st.integers(1, 10))):
        length = draw(st.integers(1, max_model_len))  # max_model_len itself is rejected
        shared = draw(st.integers(0, min(length, 24)))
        own = length - shared
        group = draw(st.integers(0, 2))
        prompt = prefixes[group][:shared] + [5000 + 100 * k + j for j in range(own)]
        specs.append(
            Spec(
                rid=f"r{k}",
                prompt=prompt,
                max_tokens=draw(st.integers(1, 12)),
                priority=draw(st.integers(0, 2)),
                arrival_step=draw(st.integers(0, 6)),
                lora_id=draw(st.integers(0, 3)),
            )
        )
    return config, specs, draw(st.integers(0, 2**16))


def fake_model(out: SchedulerOutput, rng: random.Random, num_spec: int) -> ModelRunnerOutput:
    """Sample for each complete request: 1 token plus a random number of accepted drafts."""
    sampled: list[list[int]] = []
    drafts: list[list[int]] = []
    for req in out.scheduled:
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])
        else:
            scheduled_drafts = out.spec_decode_tokens.get(req.request_id, [])
            accepted = rng.randint(0, len(scheduled_drafts))
            sampled.append([*scheduled_drafts[:accepted], 9])
        drafts.append([rng.randint(1, 50) for _ in range(rng.randint(0, num_spec))])
    return ModelRunnerOutput(sampled, draft_token_ids=drafts if num_spec else None)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_keep_every_invariant(scenario: tuple[SchedulerConfig, list[Spec], int]) -> None:
    config, specs, seed = scenario
    rng = random.Random(seed)
    sched = Scheduler(config)
    accepted: dict[str, tuple[Request, Spec]] = {}
    pending = sorted(specs, key=lambda s: s.arrival_step)
    for step in range(1000):
        while pending and pending[0].arrival_step <= step:
            spec = pending.pop(0)
            req = Request(
                spec.rid,
                spec.prompt,
                SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
                priority=spec.priority,
                arrival_time=float(step),
                lora_id=spec.lora_id,
            )
            before = (len(sched.waiting), sched.kv.num_free_blocks, sorted(sched.requests))
            try:
                sched.add_request(req)
            except RequestRejected:
                assert (len(sched.waiting), sched.kv.num_free_blocks, sorted(sched.requests)) == before
            else:
                accepted[spec.rid] = (req, spec)
        if not sched.has_requests() and not pending:
            break
        out = sched.schedule()
        counts = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(counts) <= config.max_num_batched_tokens
        assert all(n > 0 for n in counts)
        assert len({r.request_id for r in out.scheduled}) == len(out.scheduled)
        assert len(sched.running) <= config.max_num_seqs
        if out.preempted:
            assert out.admitted == []
            assert not {r.request_id for r in out.preempted} & {r.request_id for r in out.scheduled}
        if config.max_loras is not None:
            assert len({r.lora_id for r in sched.running if r.lora_id}) <= config.max_loras
        for req, n in zip(out.scheduled, counts):
            assert req.num_computed_tokens < config.max_model_len
            assert req.num_computed_tokens - n >= 0
        sched.update_from_output(out, fake_model(out, rng, config.num_speculative_tokens))
        for req in sched.running:
            if not req.is_prefill_chunk:
                assert req.num_computed_tokens == req.num_tokens - 1
    else:
        raise AssertionError("workload did not finish within 1000 steps")
    for req, spec in accepted.values():
        assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED, req
        assert req.num_tokens == min(len(spec.prompt) + spec.max_tokens, config.max_model_len)
    assert sched.kv.num_free_blocks == config.num_gpu_blocks - 1
    assert sched.kv_usage == 0.0
    sched.kv.check_invariants()
