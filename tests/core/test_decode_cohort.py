"""Decode cohorts: steps that keep plain decodes lazy leave exactly the state schedule() + update would."""

from __future__ import annotations

import random

import pytest

from llmsched.core import SamplingParams, Scheduler
from support.decode_state import feed, snapshot
from support.scheduling import make_req, make_sched, run_step


def kv_snapshot(s: Scheduler) -> dict:
    """The shared state a lazy member never holds back: tables, free queue, cache, queues, counters."""
    full = snapshot(s)
    full["running"] = [r.request_id for r in s.running]
    return full


def ids(reqs: list) -> list[str]:
    return [r.request_id for r in reqs]


def cohort_turn(lazy: Scheduler, stepped: Scheduler, cohort, rng: random.Random) -> int:
    """One admitting step or a plain run through the cohort, checked against built steps; steps taken."""
    if len(lazy.waiting) or not len(cohort):
        got = lazy.cohort_schedule(cohort)
        if got is None:
            return 0
        out, finishing = got
        ref, res = run_step(stepped, token=8)
        members = len(ref.scheduled) - len(ref.admitted)
        assert ref.num_scheduled_tokens[:members] == [1] * members and not ref.preempted
        assert ids(out.scheduled) == ids(ref.admitted) == ids(out.admitted)
        assert out.num_scheduled_tokens == ref.num_scheduled_tokens[members:]
        assert out.admitted_block_ids == ref.admitted_block_ids
        assert out.total_num_scheduled_tokens == ref.total_num_scheduled_tokens
        samplers, finished = lazy.cohort_update(cohort, out, finishing)
        assert ids(finished) == ids(res.finished)
        assert ids(samplers) == [r.request_id for r in res.updated[members:]]
        return 1
    k = lazy.cohort_plain_steps(cohort, rng.randrange(1, 12))
    if not k:
        return 0
    for _ in range(k):
        ref, res = run_step(stepped, token=8)
        assert ref.num_scheduled_tokens == [1] * len(ref.scheduled) and not ref.admitted
    finished = lazy.advance_cohort(cohort, k)
    assert ids(finished) == ids(res.finished)
    return k


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"enable_prefix_caching": False},
        {"num_gpu_blocks": 40, "max_num_seqs": 6},
        {"block_size": 16, "num_gpu_blocks": 60, "max_model_len": 96},
        {"max_num_batched_tokens": 8, "max_num_seqs": 8},
        {"max_num_batched_tokens": 256, "max_num_seqs": 4},
        {"policy": "priority", "num_gpu_blocks": 60},
    ],
)
def test_cohort_steps_equal_scheduled_steps(seed, overrides):
    rng = random.Random(seed)
    stepped, lazy = make_sched(**overrides), make_sched(**overrides, debug=False)
    shared = [900_000 + j for j in range(64)]
    cohort = None
    num_lazy = 0
    for _ in range(80):
        if rng.random() < 0.4:
            feed([stepped, lazy], random.Random(rng.random()), rng.randrange(1, 4), shared)
        if cohort is None:
            cohort = lazy.start_cohort(8)
        taken = cohort_turn(lazy, stepped, cohort, rng) if cohort is not None else 0
        num_lazy += taken
        if not taken or rng.random() < 0.25:
            if cohort is not None:
                cohort.flush()
                cohort = None
            if not taken:
                run_step(stepped, token=8)
                run_step(lazy, token=8)
        lazy._check_kv_invariants()
        # Shared state is exact at every step; a member's own counters once caught up.
        assert (kv_snapshot if cohort is not None else snapshot)(lazy) == (
            kv_snapshot if cohort is not None else snapshot
        )(stepped)
    if cohort is not None:
        cohort.flush()
    assert snapshot(lazy) == snapshot(stepped)
    assert num_lazy


def test_no_cohort_where_a_step_may_do_more():
    s = make_sched(debug=False)
    s.add_request(make_req("a", 100, max_tokens=5))
    assert len(s.start_cohort(7)) == 0  # nothing runs: a cohort of none, admissions to come
    run_step(s)
    assert s.start_cohort(7) is None  # a prompt chunk still to run is no plain decode
    run_step(s)
    assert len(s.start_cohort(7)) == 1
    stop = make_sched(debug=False)
    stop.add_request(make_req("c", 10, params=SamplingParams(max_tokens=9, stop_token_ids=[7])))
    run_step(stop, token=8)
    assert stop.start_cohort(7) is None  # would sample its stop token
    assert stop.start_cohort(8) is not None
    for config in ({"async_scheduling": True}, {"prefill_schedule_interval": 2}, {"debug": True}):
        other = make_sched(**{"debug": False, **config})
        other.add_request(make_req("d", 10))
        run_step(other)
        assert other.start_cohort(7) is None, config
