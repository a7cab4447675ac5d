"""Recompute preemption: victims under FCFS and priority, requeueing, resumption, no admissions."""

from __future__ import annotations

from llmsched.core import (
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from llmsched.engine import EngineCore
from llmsched.executor.replay import ReplayExecutor
from support.scheduling import make_req, ran, run_step, running_ids, waiting_ids
from support.scheduling import make_sched as base_sched


def make_sched(**overrides: object) -> Scheduler:
    """The shared test scheduler with a 64-token context."""
    return base_sched(**{"max_model_len": 64, **overrides})


def preempted_ids(out: SchedulerOutput) -> list[str]:
    """Preempted request ids in preemption order."""
    return [r.request_id for r in out.preempted]


def steps_until_preemption(sched: Scheduler, limit: int = 50) -> tuple[int, SchedulerOutput]:
    """Run steps until one preempts; returns (steps run before it, its output)."""
    for k in range(limit):
        out, _ = run_step(sched)
        if out.preempted:
            return k, out
    raise AssertionError(f"no preemption within {limit} steps")


# ---- FCFS -------------------------------------------------------------------------


def _two_in_lockstep(num_gpu_blocks: int, **overrides: object) -> Scheduler:
    # A and B both hold 3 blocks from step 1 on and need a 4th in step 5.
    s = make_sched(num_gpu_blocks=num_gpu_blocks, **overrides)
    s.add_request(make_req("A", 8))
    s.add_request(make_req("B", 8))
    for _ in range(5):
        out, _ = run_step(s)
        assert out.preempted == []
    return s


def test_fcfs_preempts_the_last_running_request() -> None:
    s = _two_in_lockstep(num_gpu_blocks=7)  # 6 usable: A's 4th block is missing
    b = s.requests["B"]
    assert s.kv.num_free_blocks == 0
    out, _ = run_step(s)
    assert preempted_ids(out) == ["B"]
    assert ran(out) == {"A": 1}
    assert out.total_num_scheduled_tokens == 1
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert s.num_preemptions == 1
    assert s.kv.num_held_blocks("B") == 0
    assert s.kv.num_held_blocks("A") == 4
    assert running_ids(s) == ["A"]
    assert waiting_ids(s) == ["B"]
    # The tokens it generated are kept: it recomputes them later.
    assert b.num_tokens == 8 + 5


def test_fcfs_request_preempting_itself() -> None:
    s = _two_in_lockstep(num_gpu_blocks=8)  # 7 usable: A takes the last free block
    out, _ = run_step(s)
    assert ran(out) == {"A": 1}
    assert preempted_ids(out) == ["B"]
    assert s.requests["B"].status is RequestStatus.PREEMPTED
    assert "B" not in out.new_block_ids
    assert s.kv.num_free_blocks == 3


def test_fcfs_preempts_as_many_victims_as_needed_last_first() -> None:
    s = make_sched(num_gpu_blocks=9, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    s.add_request(make_req("A", 32, max_tokens=1))
    run_step(s)
    s.add_request(make_req("B", 4, max_tokens=8))
    s.add_request(make_req("C", 4, max_tokens=8))
    out, _ = run_step(s)
    assert ran(out) == {"A": 8, "B": 4, "C": 4}
    assert s.kv.num_free_blocks == 0
    out, _ = run_step(s)
    # A's next 8-token chunk needs 2 blocks; C then B each free one.
    assert preempted_ids(out) == ["C", "B"]
    assert ran(out) == {"A": 8}
    # Each went to the front in turn: the original order is restored.
    assert waiting_ids(s) == ["B", "C"]


def test_preempted_request_is_put_ahead_of_requests_that_arrived_earlier() -> None:
    s = make_sched(num_gpu_blocks=7, max_loras=1)
    s.add_request(make_req("A", 8, lora_id=1))
    s.add_request(make_req("C", 4, lora_id=2))  # set aside: adapter slots full
    s.add_request(make_req("B", 8, lora_id=1))
    k, out = steps_until_preemption(s)
    assert k == 5
    assert preempted_ids(out) == ["B"]
    # B goes to the very front, ahead of C although C arrived before it.
    assert waiting_ids(s) == ["B", "C"]


def test_no_admissions_in_a_step_that_preempted() -> None:
    s = _two_in_lockstep(num_gpu_blocks=7)
    s.add_request(make_req("C", 4, max_tokens=1))
    out, _ = run_step(s)
    assert preempted_ids(out) == ["B"]
    # C needs one block and B just freed three (A took one), and budget is
    # plentiful, yet nothing is admitted in a preempting step.
    assert s.kv.num_free_blocks == 2
    assert out.admitted == []
    assert waiting_ids(s) == ["B", "C"]
    out, _ = run_step(s)
    # Next step the head B (13 tokens: 4 blocks) does not fit the 2 free
    # blocks, and C queued behind it is not considered: admission stops.
    assert ran(out) == {"A": 1}
    assert waiting_ids(s) == ["B", "C"]


def test_resumed_request_recomputes_from_zero_without_prefix_caching() -> None:
    s = make_sched(num_gpu_blocks=8, enable_prefix_caching=False)
    s.add_request(make_req("A", 8, max_tokens=6))
    s.add_request(make_req("B", 8))
    k, out = steps_until_preemption(s)
    assert (k, preempted_ids(out)) == (5, ["B"])
    out, _ = run_step(s)
    # A finished; B comes back and recomputes its prompt and 5 generated tokens.
    assert ran(out) == {"B": 13}
    assert out.admitted_num_cached_tokens == [0]
    assert s.requests["B"].num_computed_tokens == 13


def test_resumed_request_hits_its_own_freed_blocks() -> None:
    s = make_sched(num_gpu_blocks=8)
    s.add_request(make_req("A", 8, max_tokens=6))
    s.add_request(make_req("B", 8))
    for _ in range(5):
        run_step(s)
    old_blocks = s.kv.get_block_ids("B")
    assert len(old_blocks) == 3
    out, _ = run_step(s)
    assert preempted_ids(out) == ["B"]
    stats_before = s.prefix_cache_stats.preempted_requests
    out, _ = run_step(s)
    b = s.requests["B"]
    # 13 tokens: the three full blocks written before preemption are found
    # again (all but the last token), so only 1 token is recomputed.
    assert out.admitted == [b]
    assert out.admitted_num_cached_tokens == [12]
    assert ran(out) == {"B": 1}
    assert out.admitted_block_ids[0][:3] == old_blocks
    assert b.num_computed_tokens == 13
    assert b.status is RequestStatus.RUNNING
    assert s.prefix_cache_stats.preempted_requests == stats_before + 1
    assert s.prefix_cache_stats.preempted_hits == 12


def test_resumed_request_finishes_with_the_right_token_count() -> None:
    s = make_sched(num_gpu_blocks=7)
    s.add_request(make_req("A", 8))
    s.add_request(make_req("B", 8))
    b = s.requests["B"]
    preemptions = 0
    for _ in range(200):
        if not s.has_requests():
            break
        out, _ = run_step(s)
        preemptions += len(out.preempted)
    assert preemptions >= 1
    assert b.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert b.num_output_tokens == 16
    assert s.kv.num_free_blocks == 6


# ---- priority ------------------------------------------------------------------------


def _three_running(policy: str) -> Scheduler:
    # Running order A (p0), B (p5), C (p1); in step 5 A needs a block and none is free.
    s = make_sched(num_gpu_blocks=10, policy=policy)
    s.add_request(make_req("A", 8, priority=0, arrival_time=1.0))
    s.add_request(make_req("B", 8, priority=5, arrival_time=2.0))
    run_step(s)
    s.add_request(make_req("C", 8, priority=1, arrival_time=3.0))
    for _ in range(4):
        out, _ = run_step(s)
        assert out.preempted == []
    assert running_ids(s) == ["A", "B", "C"]
    return s


def test_priority_preempts_the_largest_priority_value_not_the_last() -> None:
    s = _three_running("priority")
    out, _ = run_step(s)
    assert preempted_ids(out) == ["B"]
    assert ran(out) == {"A": 1, "C": 1}
    assert running_ids(s) == ["A", "C"]


def test_fcfs_preempts_the_last_in_the_same_situation() -> None:
    s = _three_running("fcfs")
    out, _ = run_step(s)
    assert preempted_ids(out) == ["C"]
    assert ran(out) == {"A": 1, "B": 1}


def test_priority_breaks_ties_by_later_arrival() -> None:
    s = make_sched(num_gpu_blocks=10, policy="priority")
    s.add_request(make_req("A", 8, priority=1, arrival_time=1.0))
    s.add_request(make_req("B", 8, priority=1, arrival_time=3.0))
    run_step(s)
    s.add_request(make_req("C", 8, priority=1, arrival_time=2.0))
    _, out = steps_until_preemption(s)
    # Same priority: the latest arrival (B) goes, though C is last in running order.
    assert running_ids(s)[-1] == "C"
    assert preempted_ids(out) == ["B"]


def test_priority_victim_already_scheduled_returns_its_tokens_to_the_budget() -> None:
    s = make_sched(
        num_gpu_blocks=11,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        policy="priority",
        long_prefill_token_threshold=8,
    )
    s.add_request(make_req("B", 40, max_tokens=1, priority=5, arrival_time=1.0))
    out, _ = run_step(s)
    assert ran(out) == {"B": 16}
    s.add_request(make_req("A", 4, max_tokens=8, priority=0, arrival_time=2.0))
    s.add_request(make_req("D", 12, max_tokens=8, priority=1, arrival_time=3.0))
    out, _ = run_step(s)
    assert list(ran(out).items()) == [("B", 8), ("A", 4), ("D", 4)]
    assert s.kv.num_free_blocks == 2
    out, _ = run_step(s)
    # B ran its 8-token chunk first (taking the last 2 blocks); then A's decode
    # needs a block and B, the lowest priority, is preempted. B's 8 tokens go
    # back to the budget, so D gets its remaining 8 instead of 16 - 8 - 1 = 7.
    assert preempted_ids(out) == ["B"]
    assert list(ran(out).items()) == [("A", 1), ("D", 8)]
    assert out.total_num_scheduled_tokens == 9 == sum(out.num_scheduled_tokens)
    assert "B" not in out.new_block_ids
    assert s.requests["B"].num_computed_tokens == 0
    assert s.kv.num_held_blocks("B") == 0
    assert running_ids(s) == ["A", "D"]


def test_priority_request_preempting_itself_lets_later_ones_run() -> None:
    s = make_sched(num_gpu_blocks=7, policy="priority")
    s.add_request(make_req("X", 8, priority=9, arrival_time=1.0))
    run_step(s)
    s.add_request(make_req("Y", 8, priority=0, arrival_time=2.0))
    for _ in range(4):
        run_step(s)
    s.add_request(make_req("W", 4, max_tokens=4, priority=3, arrival_time=3.0))
    out, _ = run_step(s)
    # X needs a block, none is free, and X itself is the lowest priority.
    assert preempted_ids(out) == ["X"]
    assert ran(out) == {"Y": 1}
    # Back into the heap by key (not the front): W (p3) is ahead of X (p9).
    assert waiting_ids(s) == ["W", "X"]
    assert out.admitted == []


def test_fcfs_same_situation_preempts_the_other_request() -> None:
    s = make_sched(num_gpu_blocks=7)
    s.add_request(make_req("X", 8, priority=9, arrival_time=1.0))
    run_step(s)
    s.add_request(make_req("Y", 8, priority=0, arrival_time=2.0))
    for _ in range(4):
        run_step(s)
    s.add_request(make_req("W", 4, max_tokens=4, priority=3, arrival_time=3.0))
    out, _ = run_step(s)
    assert preempted_ids(out) == ["Y"]
    assert ran(out) == {"X": 1}
    assert waiting_ids(s) == ["Y", "W"]


def test_preemption_clears_drafts_and_prefill_flag() -> None:
    s = _two_in_lockstep(num_gpu_blocks=7)
    b = s.requests["B"]
    b.spec_token_ids = [1, 2]
    out, _ = run_step(s)
    assert preempted_ids(out) == ["B"]
    assert b.spec_token_ids == []
    assert not b.is_prefill_chunk
    assert out.spec_decode_tokens == {}


def test_priority_ties_in_priority_and_arrival_do_not_livelock() -> None:
    # Two equal requests (same priority, same arrival time) on a cache that
    # cannot hold both at full length. Picking the first running request on a
    # tie made them preempt themselves in turn forever; they must both finish.
    s = make_sched(
        num_gpu_blocks=17,
        max_model_len=14,
        max_num_batched_tokens=14,
        max_num_seqs=2,
        block_size=1,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=4,
        scheduler_reserve_full_isl=False,
        policy="priority",
    )
    reqs = [make_req(rid, 2, max_tokens=12, arrival_time=0.0) for rid in ("r0", "r1")]
    for r in reqs:
        s.add_request(r)
    for _ in range(100):
        if not s.has_requests():
            break
        run_step(s)
    assert not s.has_requests()
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert all(r.num_tokens == 14 for r in reqs)


def test_withdrawn_chunk_is_recomputed_by_whoever_hits_it() -> None:
    """A victim unscheduled mid-step keeps vLLM's hit, and its executor recomputes the gap.

    B (priority 5) has computed 24 of 36 prompt tokens and is scheduled for
    24-32 before A (priority 0), later in running order, runs out of blocks
    and preempts it. Block 24-28 was registered when allocated, but the chunk
    never runs. As in vLLM, B resumes with a 28-token hit (so the decision is
    vLLM's), and the output tells the executor to compute from 24.
    """
    cfg = SchedulerConfig(
        num_gpu_blocks=11,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=4,
        long_prefill_token_threshold=8,
        policy="priority",
    )
    engine = EngineCore(cfg, ReplayExecutor())
    b = Request(
        "B",
        list(range(100, 136)),
        SamplingParams(max_tokens=2, ignore_eos=True),
        priority=5,
        arrival_time=0.0,
    )
    a = Request(
        "A",
        list(range(200, 211)),
        SamplingParams(max_tokens=1, ignore_eos=True),
        priority=0,
        arrival_time=1.0,
    )
    engine.add_request(b)
    assert engine.step().scheduler_output.num_scheduled_tokens == [16]
    engine.add_request(a)
    assert engine.step().scheduler_output.num_scheduled_tokens == [8, 8]
    step = engine.step().scheduler_output
    assert [r.request_id for r in step.preempted] == ["B"]
    assert [r.request_id for r in step.scheduled] == ["A"]
    assert step.recompute_from == {}
    resumed = engine.step().scheduler_output
    assert [r.request_id for r in resumed.admitted] == ["B"]
    assert resumed.admitted_num_cached_tokens == [28]
    assert resumed.num_scheduled_tokens == [8]
    assert resumed.recompute_from == {"B": 24}
    # Claimed once: the blocks hold KV after this step.
    assert not engine.scheduler.kv.pool.unwritten
    engine.scheduler.kv.check_invariants()
