"""Async scheduling: output placeholders, the max_tokens skip, stale output, in-flight tokens never cached.

Each scenario drives the scheduler the way the engine's batch queue does
(see support.Pipeline): a step is planned before the previous step's output
is applied. The expected counts follow vLLM 0.33's AsyncScheduler; the two
scenarios marked "recorded" were checked against vLLM itself with its
reference driver, and the parity traces cover the rest in bulk.
"""

from __future__ import annotations

from llmsched.core import ModelRunnerOutput, Reason, Request, RequestStatus, SamplingParams
from support.scheduling import Pipeline, make_req, make_sched, ran


def counts(req: Request) -> tuple[int, int, int, int]:
    """(num_tokens, computed, placeholders, in flight)."""
    return req.num_tokens, req.num_computed_tokens, req.num_output_placeholders, req.num_in_flight_tokens


def test_placeholders_track_the_token_in_flight() -> None:
    p = Pipeline(make_sched(async_scheduling=True))
    a = make_req("A", 6, max_tokens=4)
    p.sched.add_request(a)
    assert ran(p.schedule()) == {"A": 6}
    # The prefill's token is sampled but not applied: computed counts it.
    assert counts(a) == (6, 6, 1, 6)
    # The next step is planned before that token arrives: one decode.
    assert ran(p.schedule()) == {"A": 1}
    assert counts(a) == (6, 7, 2, 7)
    p.update()
    assert counts(a) == (7, 7, 1, 1)
    assert a.output_token_ids == [7]


def test_request_certain_to_reach_max_tokens_is_not_scheduled_again() -> None:
    s = make_sched(async_scheduling=True)
    s.enable_trace()
    p = Pipeline(s)
    a = make_req("A", 6, max_tokens=4)
    s.add_request(a)
    batches = []
    while s.has_requests() or p.in_flight:
        if s.has_requests():
            out, _ = p.step()
            batches.append(ran(out))
        else:
            p.update()
    # A prefill and three decodes make its four tokens; the step planned
    # while the fourth is in flight leaves it out.
    assert batches[:5] == [{"A": 6}, {"A": 1}, {"A": 1}, {"A": 1}, {}]
    assert a.output_token_ids == [7, 7, 7, 7]
    assert a.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_max_tokens_skip_is_explained_in_the_trace() -> None:
    s = make_sched(async_scheduling=True)
    s.enable_trace()
    p = Pipeline(s)
    s.add_request(make_req("A", 6, max_tokens=1))
    s.add_request(make_req("B", 6, max_tokens=5))
    p.schedule()
    out = p.schedule()
    assert ran(out) == {"B": 1}
    e = out.trace.reason_of("A")
    assert e.reason is Reason.MAX_TOKENS_IN_FLIGHT and "already certain to reach max_tokens" in e.text()


def test_stop_token_found_one_step_late_drops_the_extra_step() -> None:
    s = make_sched(async_scheduling=True)
    p = Pipeline(s)
    params = SamplingParams(max_tokens=10)
    a = make_req("A", 5, params=params, eos_token_ids=[7])
    s.add_request(a)
    p.schedule()
    # Planned before the prefill's token (EOS) is known.
    assert ran(p.schedule()) == {"A": 1}
    res = p.update()
    assert res.finished == [a] and a.status is RequestStatus.FINISHED_STOPPED
    # Freed as soon as the stop is known; the extra step's output is dropped.
    assert s.kv.get_block_ids("A") == [] and s.kv.usage == 0.0
    res = p.update()
    assert res.updated == [] and a.output_token_ids == [7]
    assert p.schedule().finished_req_ids == ["A"]


def test_abort_while_a_step_is_in_flight() -> None:
    s = make_sched(async_scheduling=True)
    p = Pipeline(s)
    a, b = make_req("A", 5), make_req("B", 5)
    s.add_request(a)
    s.add_request(b)
    p.schedule()
    assert s.finish_requests("A") == [a]
    assert s.kv.get_block_ids("A") == []
    res = p.update()
    assert res.updated == [b] and a.num_tokens == 5
    assert ran(p.schedule()) == {"B": 1}


def test_in_flight_tokens_are_not_prefix_cached() -> None:
    """Recorded: vLLM's sync scheduler gives B an 8-token hit here, its AsyncScheduler 4."""
    hits = {}
    for mode in (False, True):
        s = make_sched(async_scheduling=mode, max_num_batched_tokens=64, num_gpu_blocks=20)
        p = Pipeline(s)
        s.add_request(Request("A", [5] * 7, SamplingParams(max_tokens=4, ignore_eos=True)))
        p.schedule()
        if not mode:
            p.update()
        # B's second block holds A's first output token, in flight in async mode.
        s.add_request(Request("B", [5] * 7 + [7] + [9] * 4, SamplingParams(max_tokens=2, ignore_eos=True)))
        out = p.schedule()
        hits[mode] = out.admitted_num_cached_tokens[0]
    assert hits == {False: 8, True: 4}


def _stale_case() -> tuple[Pipeline, Request, Request]:
    """Three requests in a 3-block cache: A's first decode needs the block B holds."""
    s = make_sched(async_scheduling=True, num_gpu_blocks=4, scheduler_reserve_full_isl=False)
    s.enable_trace()
    p = Pipeline(s)
    a = Request("A", list(range(1, 9)), SamplingParams(max_tokens=4, ignore_eos=True))
    b = Request("B", [11, 12, 13], SamplingParams(max_tokens=1, ignore_eos=True))
    c = Request("C", [21, 22, 23], SamplingParams(max_tokens=3, ignore_eos=True))
    for r in (a, b, c):
        s.add_request(r)
    return p, a, b


def test_stale_output_of_a_preempted_request_still_arrives_and_can_finish_it() -> None:
    """Recorded: vLLM finishes B with the update of step 0, after preempting it in step 1."""
    p, _, b = _stale_case()
    assert ran(p.schedule()) == {"A": 8, "B": 3}
    out = p.schedule()
    assert ran(out) == {"A": 1} and out.preempted == [b]
    # Preemption reset B's counters; its step in flight is now stale.
    assert (b.num_computed_tokens, b.num_output_placeholders, b.num_stale_output_tokens) == (0, 0, 3)
    res = p.update()
    assert b in res.updated and res.finished == [b]
    assert b.output_token_ids == [7] and b.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert b not in list(p.sched.waiting) and "B" not in p.sched.requests
    assert b.num_stale_output_tokens == 0 and b.num_in_flight_tokens == 0


def test_preempted_request_keeps_its_stale_token_and_resumes_with_it() -> None:
    s = make_sched(async_scheduling=True, num_gpu_blocks=4, scheduler_reserve_full_isl=False)
    p = Pipeline(s)
    a = Request("A", list(range(1, 9)), SamplingParams(max_tokens=4, ignore_eos=True))
    b = Request("B", [11, 12, 13], SamplingParams(max_tokens=3, ignore_eos=True))
    s.add_request(a)
    s.add_request(b)
    p.schedule()
    out = p.schedule()
    assert out.preempted == [b]
    p.update()
    # The stale token is B's: kept, but it moves no counter the preemption reset.
    assert counts(b) == (4, 0, 0, 0) and b.status is RequestStatus.PREEMPTED
    while b.status is not RequestStatus.RUNNING:
        p.step()
    # Resumed: the whole sequence, stale token included, is recomputed.
    admitted = p.in_flight[-1][0]
    assert admitted.admitted == [b] and admitted.admitted_resumed == [True]
    assert ran(admitted)["B"] == 4


def test_resume_waits_while_a_stale_step_is_still_in_flight() -> None:
    p, _, b = _stale_case()
    p.schedule()
    p.schedule()  # preempts B while step 0 (holding B's prefill) is in flight
    # A third step planned before step 0's output is applied (a deeper
    # pipeline than the engine's): B must not resume yet.
    out = p.schedule()
    assert "B" not in ran(out)
    assert out.trace.reason_of("B").reason is Reason.OUTPUT_IN_FLIGHT
    assert next(iter(p.sched.waiting)) is b


def _drafting(max_tokens: int) -> tuple[Pipeline, Request]:
    """Async mode with two draft tokens a step; one 6-token request, its prefill planned."""
    p = Pipeline(make_sched(async_scheduling=True, num_speculative_tokens=2))
    a = make_req("A", 6, max_tokens=max_tokens)
    p.sched.add_request(a)
    p.schedule()
    return p, a


def test_draft_placeholders_and_rejections() -> None:
    p, a = _drafting(max_tokens=20)
    # After a sampling step the next drafts are placeholders (their ids are the executor's).
    assert a.spec_token_ids == [-1, -1] and a.num_output_placeholders == 1
    out = p.schedule()
    assert ran(out) == {"A": 3} and out.spec_decode_tokens == {"A": [-1, -1]}
    assert counts(a) == (6, 9, 4, 9)
    p.update()  # the prefill's one token
    assert counts(a) == (7, 9, 3, 3)
    out = p.schedule()
    assert ran(out) == {"A": 3}
    assert counts(a) == (7, 12, 6, 6)
    # Step 1 accepted one of its two drafts: one position is rolled back.
    p.update(ModelRunnerOutput([[8, 9]]))
    assert counts(a) == (9, 11, 3, 3)
    assert a.output_token_ids == [7, 8, 9]


def test_drafts_are_discounted_from_the_max_tokens_skip() -> None:
    p, a = _drafting(max_tokens=3)
    assert ran(p.schedule()) == {"A": 3}
    p.update()
    # In flight: step 1's bonus token and two drafts. Only the bonus token is
    # certain, which leaves A one short of max_tokens: it is scheduled again.
    certain = a.num_computed_tokens + 2 - a.num_output_placeholders
    assert (certain, a.num_prompt_tokens + a.max_tokens) == (8, 9)
    assert ran(p.schedule()) == {"A": 3}


def test_sync_mode_leaves_the_async_counters_at_zero() -> None:
    p = Pipeline(make_sched())
    a = make_req("A", 6, max_tokens=3)
    p.sched.add_request(a)
    while p.sched.has_requests():
        p.schedule()
        assert (a.num_output_placeholders, a.num_in_flight_tokens, a.num_stale_output_tokens) == (0, 0, 0)
        p.update()
    assert a.output_token_ids == [7, 7, 7]
