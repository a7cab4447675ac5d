"""Request lifecycle in the scheduler: stop rules, finishing, aborts, rejections, debug checks."""

from __future__ import annotations

import pytest

from llmsched.core import (
    ModelRunnerOutput,
    Request,
    RequestRejected,
    RequestStatus,
    SamplingParams,
    Scheduler,
)
from support.scheduling import make_req, run_step
from support.scheduling import make_sched as base_sched


def make_sched(**overrides: object) -> Scheduler:
    """The shared test scheduler with a 64-token context and 64 blocks."""
    return base_sched(**{"num_gpu_blocks": 65, "max_model_len": 64, **overrides})


def snapshot(sched: Scheduler) -> tuple:
    """Everything add_request could disturb."""
    return (
        sorted(sched.requests),
        [r.request_id for r in sched.waiting],
        [r.request_id for r in sched.running],
        sched.kv.num_free_blocks,
        sched.kv_usage,
        sched.has_requests(),
    )


def assert_no_leak(sched: Scheduler) -> None:
    """Every usable block is free and accounted for."""
    assert sched.kv.num_free_blocks == sched.config.num_gpu_blocks - 1
    assert sched.kv_usage == 0.0
    assert sched.running == [] and len(sched.waiting) == 0 and sched.requests == {}
    sched.kv.check_invariants()


# ---- stop conditions ----------------------------------------------------------------


def test_eos_stops_the_request() -> None:
    s = make_sched()
    r = make_req("A", 5, params=SamplingParams(max_tokens=10), eos_token_ids=[2])
    s.add_request(r)
    _, res = run_step(s, token=5)
    assert res.finished == []
    _, res = run_step(s, token=2)
    assert res.finished == [r]
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.finish_reason == "stop"
    assert r.stop_reason is None
    assert r.output_token_ids == [5, 2]  # the EOS token is part of the output
    assert_no_leak_after_report(s)


def assert_no_leak_after_report(sched: Scheduler) -> None:
    """Blocks are free already; the next step reports the finish and leaves nothing."""
    assert sched.kv.num_free_blocks == sched.config.num_gpu_blocks - 1
    sched.schedule()
    assert not sched.has_requests()
    assert_no_leak(sched)


def test_ignore_eos_keeps_going_to_max_tokens() -> None:
    s = make_sched()
    r = make_req("A", 5, params=SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids=[2])
    s.add_request(r)
    for _ in range(3):
        _, res = run_step(s, token=2)
        assert res.finished == []
    _, res = run_step(s, token=2)
    assert res.finished == [r]
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.output_token_ids == [2, 2, 2, 2]


def test_stop_token_id_stops_and_is_recorded_as_the_reason() -> None:
    s = make_sched()
    r = make_req("A", 5, params=SamplingParams(max_tokens=10, stop_token_ids=[42]), eos_token_ids=[2])
    s.add_request(r)
    run_step(s, token=9)
    _, res = run_step(s, token=42)
    assert res.finished == [r]
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 42
    assert r.output_token_ids == [9, 42]


def test_max_tokens_caps_the_output() -> None:
    s = make_sched()
    r = make_req("A", 5, max_tokens=3)
    s.add_request(r)
    finished_at = None
    for k in range(10):
        _, res = run_step(s)
        if res.finished:
            finished_at = k
            break
    assert finished_at == 2
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.finish_reason == "length"
    assert r.num_output_tokens == 3


def test_max_model_len_caps_the_output() -> None:
    s = make_sched(max_model_len=16)
    r = make_req("A", 10, max_tokens=100)
    s.add_request(r)
    assert r.stop_length == 16
    while not r.is_finished:
        run_step(s)
        # Positions stay below max_model_len.
        assert r.num_computed_tokens <= 15
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.num_tokens == 16
    assert r.num_output_tokens == 6


def test_eos_on_the_last_allowed_token_counts_as_a_stop() -> None:
    s = make_sched()
    r = make_req("A", 5, params=SamplingParams(max_tokens=2), eos_token_ids=[2])
    s.add_request(r)
    run_step(s, token=9)
    _, res = run_step(s, token=2)
    assert res.finished == [r]
    # EOS is checked before the length limit, as in vLLM.
    assert r.finish_reason == "stop"


def test_min_tokens_holds_back_eos_and_stop_ids() -> None:
    s = make_sched()
    params = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[42])
    r = make_req("A", 5, params=params, eos_token_ids=[2])
    s.add_request(r)
    for tok in (2, 42, 2):
        _, res = run_step(s, token=tok)
        assert res.finished == [], f"stopped on token {tok} before min_tokens"
    # Three tokens generated: the fourth may stop it.
    _, res = run_step(s, token=2)
    assert res.finished == [r]
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [2, 42, 2, 2]


def test_min_tokens_does_not_hold_back_the_length_limit() -> None:
    s = make_sched()
    r = make_req("A", 5, params=SamplingParams(max_tokens=2, min_tokens=2))
    s.add_request(r)
    run_step(s)
    _, res = run_step(s)
    assert res.finished == [r]
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_finished_requests_leave_running_and_report_in_the_next_output() -> None:
    s = make_sched()
    s.add_request(make_req("A", 4, max_tokens=1))
    s.add_request(make_req("B", 4, max_tokens=3))
    out, res = run_step(s)
    assert [r.request_id for r in res.finished] == ["A"]
    assert out.finished_req_ids == []
    assert [r.request_id for r in s.running] == ["B"]
    assert "A" not in s.requests
    out, _ = run_step(s)
    assert out.finished_req_ids == ["A"]
    out, res = run_step(s)
    assert out.finished_req_ids == []
    assert [r.request_id for r in res.finished] == ["B"]
    assert not s.has_unfinished_requests()
    # Nothing runs, but a finish is still to be reported.
    assert s.has_requests()
    out = s.schedule()
    assert out.finished_req_ids == ["B"]
    assert out.scheduled == []
    assert not s.has_requests()


# ---- no KV leak -------------------------------------------------------------------------


def test_no_kv_leak_after_a_workload_with_preemption_and_shared_prefixes() -> None:
    s = make_sched(num_gpu_blocks=20, max_num_batched_tokens=24, long_prefill_token_threshold=10)
    shared = list(range(500, 512))
    reqs = []
    for k in range(10):
        prompt = (
            shared + [1000 * k + j for j in range(3 + 2 * k)] if k % 2 else [2000 * k + j for j in range(9)]
        )
        reqs.append(Request(f"r{k}", prompt, SamplingParams(max_tokens=5 + k, ignore_eos=True)))
        s.add_request(reqs[-1])
    preemptions = 0
    hits = 0
    for _ in range(1000):
        if not s.has_requests():
            break
        out, _ = run_step(s)
        preemptions += len(out.preempted)
        hits += sum(out.admitted_num_cached_tokens)
    # The scenario exercises the paths that could leak.
    assert preemptions > 0 and hits > 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert_no_leak(s)


# ---- aborts -------------------------------------------------------------------------------


def test_abort_running_request_frees_its_blocks() -> None:
    s = make_sched()
    s.add_request(make_req("A", 10))
    s.add_request(make_req("B", 10))
    run_step(s)
    free = s.kv.num_free_blocks
    held = s.kv.num_held_blocks("A")
    assert held == 3
    found = s.finish_requests("A")
    assert [r.request_id for r in found] == ["A"]
    assert found[0].status is RequestStatus.FINISHED_ABORTED
    assert found[0].finish_reason == "abort"
    assert [r.request_id for r in s.running] == ["B"]
    assert s.kv.num_free_blocks == free + held
    out, _ = run_step(s)
    assert out.finished_req_ids == ["A"]
    assert out.num_scheduled_tokens_by_id() == {"B": 1}


def test_abort_waiting_request() -> None:
    s = make_sched(max_num_seqs=1)
    s.add_request(make_req("A", 4))
    s.add_request(make_req("B", 4))
    s.add_request(make_req("C", 4))
    run_step(s)
    found = s.finish_requests(["B"])
    assert [r.request_id for r in found] == ["B"]
    assert [r.request_id for r in s.waiting] == ["C"]
    out, _ = run_step(s)
    assert out.finished_req_ids == ["B"]


def test_abort_preempted_request() -> None:
    s = make_sched(num_gpu_blocks=7)
    s.add_request(make_req("A", 8))
    s.add_request(make_req("B", 8))
    preempted = []
    while not preempted:
        out, _ = run_step(s)
        preempted = out.preempted
    b = preempted[0]
    assert b.status is RequestStatus.PREEMPTED
    assert s.finish_requests(b.request_id) == [b]
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert len(s.waiting) == 0


def test_abort_unknown_and_finished_ids_are_no_ops() -> None:
    s = make_sched()
    s.add_request(make_req("A", 4, max_tokens=1))
    s.add_request(make_req("B", 4))
    run_step(s)
    run_step(s)  # reports A
    before = snapshot(s)
    assert s.finish_requests(["nope", "A"]) == []
    assert s.finish_requests("A") == []
    assert snapshot(s) == before
    out, _ = run_step(s)
    assert out.finished_req_ids == []


def test_abort_same_id_twice_in_one_call() -> None:
    s = make_sched()
    s.add_request(make_req("A", 4))
    found = s.finish_requests(["A", "A"])
    assert len(found) == 1
    assert s.schedule().finished_req_ids == ["A"]


def test_abort_between_schedule_and_update_drops_the_output() -> None:
    s = make_sched()
    s.add_request(make_req("A", 4))
    s.add_request(make_req("B", 4))
    out = s.schedule()
    a = s.finish_requests("A")[0]
    res = s.update_from_output(out, ModelRunnerOutput([[7], [7]]))
    assert [r.request_id for r in res.updated] == ["B"]
    assert a.output_token_ids == []
    assert a.status is RequestStatus.FINISHED_ABORTED


def test_finish_requests_needs_a_finished_status() -> None:
    s = make_sched()
    s.add_request(make_req("A", 4))
    with pytest.raises(ValueError, match="RUNNING"):
        s.finish_requests("A", RequestStatus.RUNNING)
    assert "A" in s.requests


def test_finish_requests_with_another_finished_status() -> None:
    s = make_sched()
    s.add_request(make_req("A", 4))
    (a,) = s.finish_requests("A", RequestStatus.FINISHED_ERROR)
    assert a.finish_reason == "error"


# ---- add_request rejections -------------------------------------------------------------


def _busy_scheduler() -> Scheduler:
    s = make_sched(num_gpu_blocks=9)  # 8 usable blocks = 32 slots
    s.add_request(make_req("A", 8))
    s.add_request(make_req("B", 6))
    run_step(s)
    s.add_request(make_req("C", 4))
    return s


@pytest.mark.parametrize(
    ("rid", "prompt_len", "max_tokens", "message"),
    [
        ("A", 4, 16, "already in use"),
        ("C", 4, 16, "already in use"),
        ("E", 0, 16, "empty"),
        ("E", 64, 16, "max_model_len"),
        ("E", 100, 16, "max_model_len"),
        ("E", 20, 20, "KV blocks"),
    ],
    ids=[
        "duplicate-running",
        "duplicate-waiting",
        "empty",
        "prompt-equals-max-len",
        "too-long",
        "never-fits",
    ],
)
def test_rejections_raise_and_leave_everything_untouched(
    rid: str, prompt_len: int, max_tokens: int, message: str
) -> None:
    s = _busy_scheduler()
    before = snapshot(s)
    held = {r: s.kv.get_block_ids(r) for r in ("A", "B")}
    original = s.requests.get(rid)
    with pytest.raises(RequestRejected, match=message) as info:
        s.add_request(make_req(rid, prompt_len, max_tokens=max_tokens))
    assert repr(rid) in str(info.value)  # the message names the request
    assert snapshot(s) == before
    assert {r: s.kv.get_block_ids(r) for r in ("A", "B")} == held
    # A duplicated id still maps to the original request.
    assert s.requests.get(rid) is original
    s.kv.check_invariants()


def test_rejection_does_not_block_the_requests_behind_it() -> None:
    s = make_sched()
    s.add_request(make_req("A", 4))
    for bad in (make_req("A", 4), make_req("X", 0), make_req("Y", 64)):
        with pytest.raises(RequestRejected):
            s.add_request(bad)
    s.add_request(make_req("B", 4))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens_by_id() == {"A": 4, "B": 4}


def test_rejection_messages_are_specific() -> None:
    s = make_sched(num_gpu_blocks=5)  # 4 usable blocks of 4 tokens
    with pytest.raises(RequestRejected) as info:
        s.add_request(make_req("big", 10, max_tokens=10))
    msg = str(info.value)
    assert "'big'" in msg and "20 tokens" in msg and "5 KV blocks" in msg and "4" in msg
    with pytest.raises(RequestRejected) as info:
        s.add_request(make_req("long", 70))
    assert "70 tokens" in str(info.value) and "64" in str(info.value)


def test_limits_at_their_boundaries_are_accepted() -> None:
    # A prompt of max_model_len - 1 tokens leaves room for one output token.
    s = make_sched()
    s.add_request(make_req("edge", 63, max_tokens=1))
    assert [r.request_id for r in s.waiting] == ["edge"]
    # 8 + 9 tokens = 17, of which 16 are ever computed: exactly the 4-block cache.
    s = make_sched(num_gpu_blocks=5)
    s.add_request(make_req("full", 8, max_tokens=9))
    assert [r.request_id for r in s.waiting] == ["full"]
    while s.has_requests():
        run_step(s)
    assert s.kv.num_free_blocks == 4


def test_request_scheduled_before_cannot_be_added_again() -> None:
    s = make_sched()
    r = make_req("A", 4, max_tokens=1)
    s.add_request(r)
    run_step(s)
    assert r.is_finished
    with pytest.raises(RequestRejected, match="fresh Request"):
        s.add_request(r)


def test_finished_request_id_can_be_reused() -> None:
    s = make_sched()
    s.add_request(make_req("A", 4, max_tokens=1))
    run_step(s)
    s.add_request(Request("A", [3, 1, 4, 1, 5, 9], SamplingParams(max_tokens=1)))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens_by_id() == {"A": 6}
    assert out.finished_req_ids == ["A"]


# ---- debug mode ---------------------------------------------------------------------------


def test_debug_mode_catches_a_corrupted_reference_count() -> None:
    s = make_sched()
    s.add_request(make_req("A", 8))
    run_step(s)
    block = s.kv.pool.blocks[s.kv.get_block_ids("A")[0]]
    block.ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        s.schedule()


def test_debug_mode_catches_corruption_during_update() -> None:
    s = make_sched()
    s.add_request(make_req("A", 8))
    out = s.schedule()
    s.kv.pool.blocks[s.kv.get_block_ids("A")[-1]].ref_cnt = 0
    with pytest.raises(AssertionError):
        s.update_from_output(out, ModelRunnerOutput([[7]]))


def test_debug_mode_catches_free_block_accounting_drift() -> None:
    s = make_sched()
    s.add_request(make_req("A", 8))
    run_step(s)
    s.kv.pool.free_queue.num_free -= 1
    with pytest.raises(AssertionError, match="free queue"):
        s.schedule()


def test_debug_mode_catches_a_scheduled_request_that_is_not_running() -> None:
    s = make_sched()
    s.add_request(make_req("A", 8))
    run_step(s)
    s.running[0].status = RequestStatus.WAITING
    with pytest.raises(AssertionError, match="not running"):
        s.schedule()


def test_debug_mode_catches_too_many_running() -> None:
    s = make_sched(max_num_seqs=1)
    s.add_request(make_req("A", 8))
    run_step(s)
    s.running.append(s.running[0])
    with pytest.raises(AssertionError, match="2 running"):
        s.schedule()


def test_without_debug_the_checks_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMSCHED_DEBUG", raising=False)
    s = make_sched(debug=False)
    s.add_request(make_req("A", 8))
    run_step(s)
    s.kv.pool.blocks[s.kv.get_block_ids("A")[0]].ref_cnt += 1
    out = s.schedule()
    assert out.num_scheduled_tokens_by_id() == {"A": 1}


def test_a_request_with_n_above_1_is_refused_not_run_as_one_sequence() -> None:
    s = make_sched()
    before = snapshot(s)
    with pytest.raises(RequestRejected, match=r"'fork': n=3, but a scheduler request is one sequence"):
        s.add_request(Request("fork", [1, 2, 3], SamplingParams(n=3)))
    assert snapshot(s) == before and "fork" not in s.requests
