"""Decode cohorts: steps that keep plain decodes lazy leave exactly the state schedule() + update would."""

from __future__ import annotations

import random

import pytest

from llmsched.core import SamplingParams, Scheduler
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.core.plain_decodes import PlainDecodes
from support.decode_state import feed, snapshot
from support.scheduling import Pipeline, fabricate, make_req, make_sched, run_step


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
        got = PlainDecodes(lazy).cohort_schedule(cohort)
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
        samplers, finished = PlainDecodes(lazy).cohort_update(cohort, out, finishing)
        assert ids(finished) == ids(res.finished)
        assert ids(samplers) == [r.request_id for r in res.updated[members:]]
        return 1
    k = PlainDecodes(lazy).cohort_plain_steps(cohort, rng.randrange(1, 12))
    if not k:
        return 0
    for _ in range(k):
        ref, res = run_step(stepped, token=8)
        assert ref.num_scheduled_tokens == [1] * len(ref.scheduled) and not ref.admitted
    finished = PlainDecodes(lazy).advance_cohort(cohort, k)
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
            cohort = PlainDecodes(lazy).start_cohort(8)
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
    assert len(PlainDecodes(s).start_cohort(7)) == 0  # nothing runs: a cohort of none, admissions to come
    run_step(s)
    assert PlainDecodes(s).start_cohort(7) is None  # a prompt chunk still to run is no plain decode
    run_step(s)
    assert len(PlainDecodes(s).start_cohort(7)) == 1
    stop = make_sched(debug=False)
    stop.add_request(make_req("c", 10, params=SamplingParams(max_tokens=9, stop_token_ids=[7])))
    run_step(stop, token=8)
    assert PlainDecodes(stop).start_cohort(7) is None  # would sample its stop token
    assert PlainDecodes(stop).start_cohort(8) is not None
    for config in ({"async_scheduling": True}, {"prefill_schedule_interval": 2}, {"debug": True}):
        other = make_sched(**{"debug": False, **config})
        other.add_request(make_req("d", 10))
        run_step(other)
        assert PlainDecodes(other).start_cohort(7) is None, config


def async_snapshot(s: Scheduler) -> dict:
    """``snapshot`` plus what async mode keeps per running request: placeholders and tokens in flight."""
    full = snapshot(s)
    full["in_flight"] = [(r.num_output_placeholders, r.num_in_flight_tokens) for r in s.running]
    return full


def plain_in_flight(pipe: Pipeline) -> bool:
    """True when the one step in flight decoded every running request one token."""
    if len(pipe.in_flight) != 1:
        return False
    out = pipe.in_flight[0][0]
    running = pipe.sched.running
    return len(out.scheduled) == len(running) and all(
        a is b and n == 1 for a, b, n in zip(out.scheduled, running, out.num_scheduled_tokens)
    )


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"enable_prefix_caching": False},
        {"num_gpu_blocks": 40, "max_num_seqs": 6},
        {"block_size": 16, "num_gpu_blocks": 60, "max_model_len": 96},
        {"max_num_batched_tokens": 8, "max_num_seqs": 8},
        {"policy": "priority", "num_gpu_blocks": 60},
    ],
)
def test_async_plain_decode_calls_equal_scheduled_calls(seed, overrides):
    rng = random.Random(seed)
    config = {"async_scheduling": True, **overrides}
    stepped = Pipeline(make_sched(**config), token=8)
    lazy = Pipeline(make_sched(**config, debug=False), token=8)
    shared = [900_000 + j for j in range(64)]
    num_lazy = num_finished = 0
    for turn in range(300):
        # Bursts of arrivals, then quiet stretches in which the queue drains.
        if turn % 60 < 10 and rng.random() < 0.4:
            feed([stepped.sched, lazy.sched], random.Random(rng.random()), rng.randrange(1, 4), shared)
        k = PlainDecodes(lazy.sched).async_plain_decode_steps(
            8, rng.randrange(1, 12), through_finish=rng.random() < 0.7
        )
        if k and plain_in_flight(lazy):
            res = None
            for _ in range(k):
                _, res = stepped.step()
            lazy.in_flight.clear()
            finished = PlainDecodes(lazy.sched).advance_async_decode_steps(k, 8, through_finish=True)
            assert [r.request_id for r in finished] == [r.request_id for r in res.finished]
            # The last call's step goes in flight, as the engine does it.
            last = SchedulerOutput(
                lazy.sched.next_step - 1, list(lazy.sched.running), [1] * len(lazy.sched.running)
            )
            lazy.in_flight.append((last, ModelRunnerOutput([[8]] * len(last.scheduled))))
            assert [r.request_id for r in stepped.in_flight[0][0].scheduled] == [
                r.request_id for r in last.scheduled
            ]
            num_lazy += k
            num_finished += len(finished)
        else:
            stepped.step()
            lazy.step()
        lazy.sched._check_kv_invariants()
        assert async_snapshot(lazy.sched) == async_snapshot(stepped.sched)
    assert num_lazy and num_finished, (num_lazy, num_finished)


def test_no_async_plain_calls_where_a_call_may_do_more():
    s = make_sched(async_scheduling=True, debug=False)
    pipe = Pipeline(s, token=8)
    s.add_request(make_req("a", 10, max_tokens=20))
    assert PlainDecodes(s).async_plain_decode_steps(8, 10) == 0  # waiting
    pipe.step()
    pipe.step()
    assert PlainDecodes(s).async_plain_decode_steps(8, 10) == 10
    assert PlainDecodes(s).async_plain_decode_steps(7, 10) == 10  # ignore_eos: no stop token
    s.add_request(make_req("b", 10))
    assert PlainDecodes(s).async_plain_decode_steps(8, 10) == 0  # b waits
    sync = make_sched(debug=False)
    sync.add_request(make_req("c", 10))
    run_step(sync)
    assert PlainDecodes(sync).async_plain_decode_steps(8, 10) == 0


def async_cohort_plain_run(lazy: Pipeline, stepped: Pipeline, cohort, rng: random.Random) -> int:
    """Plain calls of the async cohort, checked against scheduled calls; how many ran."""
    k = PlainDecodes(lazy.sched).async_cohort_plain_calls(cohort, rng.randrange(1, 12))
    if not k:
        return 0
    for _ in range(k):
        ref, res = stepped.step()
        assert ref.num_scheduled_tokens == [1] * len(ref.scheduled) and not ref.admitted
    finishing = cohort.finishing(k - 1)
    last = PlainDecodes(lazy.sched).advance_async_cohort(cohort, k, finishing)
    assert ids(finishing) == ids(res.finished)
    # The last call's step goes in flight, as the engine does it.
    assert ids(last.scheduled) == ids(ref.scheduled) and last.step == ref.step
    lazy.in_flight[:] = [(last, fabricate(last, 8))]
    return k


def async_cohort_call(lazy: Pipeline, stepped: Pipeline, cohort) -> bool:
    """One engine call through the async cohort, checked against a scheduled call; False if it declined."""
    got = PlainDecodes(lazy.sched).async_cohort_schedule(cohort)
    if got is None:
        return False
    out, finishing, decodes, _ = got
    prev, prev_result = lazy.in_flight.pop(0)
    lazy.in_flight.append((out, fabricate(out, 8)))
    samplers, members, finished = PlainDecodes(lazy.sched).async_cohort_update(
        cohort, prev, prev_result, finishing, decodes
    )
    ref, res = stepped.step()
    assert res is not None and not ref.preempted
    assert ids(out.scheduled) == ids(ref.scheduled)
    assert out.num_scheduled_tokens == ref.num_scheduled_tokens
    assert out.num_scheduled_tokens[:decodes] == [1] * decodes
    assert out.total_num_scheduled_tokens == ref.total_num_scheduled_tokens
    assert ids(out.admitted) == ids(ref.admitted)
    assert out.admitted_block_ids == ref.admitted_block_ids
    assert out.finished_req_ids == ref.finished_req_ids
    assert ids(finished) == ids(res.finished)
    # The members sampled first (lazily); the rest went through update_from_output's code.
    assert ids(samplers) == ids(res.updated[members:])
    return True


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"enable_prefix_caching": False},
        {"num_gpu_blocks": 40, "max_num_seqs": 6},
        {"block_size": 16, "num_gpu_blocks": 60, "max_model_len": 96},
        {"max_num_batched_tokens": 16, "max_num_seqs": 8},
        {"max_num_batched_tokens": 256, "max_num_seqs": 4},
        {"policy": "priority", "num_gpu_blocks": 60},
    ],
)
def test_async_cohort_calls_equal_scheduled_calls(seed, overrides):
    rng = random.Random(seed)
    config = {"async_scheduling": True, **overrides}
    stepped = Pipeline(make_sched(**config), token=8)
    lazy = Pipeline(make_sched(**config, debug=False), token=8)
    shared = [900_000 + j for j in range(64)]
    cohort = None
    num_lazy = num_joined = num_plain = 0
    for turn in range(300):
        # Bursts of arrivals, then quiet stretches in which the cohort decodes alone.
        if turn % 50 < 20 and rng.random() < 0.4:
            feed([stepped.sched, lazy.sched], random.Random(rng.random()), rng.randrange(1, 4), shared)
        if cohort is None and len(lazy.in_flight) == 1 and len(lazy.sched.waiting):
            cohort = PlainDecodes(lazy.sched).start_async_cohort(8, lazy.in_flight[0][0])
        before = len(cohort) if cohort is not None else 0
        taken = False
        if cohort is not None and not len(lazy.sched.waiting) and len(lazy.sched.running) == len(cohort):
            k = async_cohort_plain_run(lazy, stepped, cohort, rng)
            num_plain += k
            taken = k > 0
        elif cohort is not None:
            taken = async_cohort_call(lazy, stepped, cohort)
            num_lazy += taken
        if taken:
            num_joined += len(cohort) > before
        if not taken or rng.random() < 0.2:
            if cohort is not None:
                cohort.flush()
                cohort = None
            if not taken:
                stepped.step()
                lazy.step()
        lazy.sched._check_kv_invariants()
        # Shared state is exact at every call; the members' own counters once caught up.
        snap = kv_snapshot if cohort is not None else async_snapshot
        assert snap(lazy.sched) == snap(stepped.sched)
    if cohort is not None:
        cohort.flush()
    assert async_snapshot(lazy.sched) == async_snapshot(stepped.sched)
    assert num_lazy
    # Small KV caches and sequence caps leave few quiet stretches; the default leaves many.
    assert num_plain or overrides
    # Small budgets chunk most prompts: their requests rarely join.
    assert num_joined or overrides.get("max_num_batched_tokens") == 16, num_joined


def test_no_async_cohort_where_a_call_may_do_more():
    s = make_sched(async_scheduling=True, debug=False)
    pipe = Pipeline(s, token=8)
    s.add_request(make_req("a", 10, max_tokens=20))
    pipe.step()
    assert PlainDecodes(s).start_async_cohort(8, pipe.in_flight[0][0]) is None  # its prefill is in flight
    pipe.step()
    cohort = PlainDecodes(s).start_async_cohort(8, pipe.in_flight[0][0])
    assert cohort is not None and len(cohort) == 1
    cohort.flush()
    assert (
        PlainDecodes(s).start_async_cohort(7, pipe.in_flight[0][0]) is not None
    )  # ignore_eos: no stop token
    s.add_request(make_req("b", 30))
    pipe.step()  # b's prefill in flight behind a
    chunked = make_sched(async_scheduling=True, debug=False, max_num_batched_tokens=8, max_num_seqs=4)
    for config in ({"prefill_schedule_interval": 2}, {"debug": True}):
        other = make_sched(**{"async_scheduling": True, "debug": False, **config})
        other_pipe = Pipeline(other, token=8)
        other.add_request(make_req("d", 10, max_tokens=20))
        other_pipe.step()
        other_pipe.step()
        assert PlainDecodes(other).start_async_cohort(8, other_pipe.in_flight[0][0]) is None, config
    chunked_pipe = Pipeline(chunked, token=8)
    chunked.add_request(make_req("e", 10, max_tokens=20))
    chunked_pipe.step()
    chunked_pipe.step()
    chunked_pipe.step()
    cohort = PlainDecodes(chunked).start_async_cohort(8, chunked_pipe.in_flight[0][0])
    assert cohort is not None
    chunked.add_request(make_req("f", 30))
    assert PlainDecodes(chunked).async_cohort_schedule(cohort) is not None  # f's first chunk is admitted
    chunked_pipe.in_flight.pop(0)
    # f's next chunk is no plain decode: the cohort declines the call and changes nothing.
    before = snapshot(chunked)
    assert PlainDecodes(chunked).async_cohort_schedule(cohort) is None
    assert snapshot(chunked) == before
