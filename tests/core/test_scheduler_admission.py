"""Scheduler admission: order, token budget, max_num_seqs, chunking, reservation, watermark, LoRA."""

from __future__ import annotations

import pytest

from llmsched.core import (
    ModelRunnerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from llmsched.core.policy import FCFSPolicy
from support.scheduling import make_req, make_sched, ran, run_step, running_ids, waiting_ids

# ---- order and budget ----------------------------------------------------------


def test_admission_in_arrival_order_until_the_budget_is_spent() -> None:
    s = make_sched()
    for rid in "ABC":
        s.add_request(make_req(rid, 30))
    out, _ = run_step(s)
    # A and B fit whole; C gets the 4 tokens left (chunked prefill).
    assert list(ran(out).items()) == [("A", 30), ("B", 30), ("C", 4)]
    assert out.total_num_scheduled_tokens == 64
    assert [r.request_id for r in out.admitted] == ["A", "B", "C"]
    assert running_ids(s) == ["A", "B", "C"]
    assert waiting_ids(s) == []
    assert s.requests["C"].is_prefill_chunk
    assert not s.requests["A"].is_prefill_chunk


def test_running_requests_are_served_before_waiting_ones() -> None:
    s = make_sched()
    for rid in "ABC":
        s.add_request(make_req(rid, 30))
    run_step(s)
    s.add_request(make_req("D", 50))
    out, _ = run_step(s)
    # Decodes for A and B, the rest of C's prompt, then D gets what is left.
    assert list(ran(out).items()) == [("A", 1), ("B", 1), ("C", 26), ("D", 36)]
    assert out.total_num_scheduled_tokens == 64
    assert [r.request_id for r in out.admitted] == ["D"]
    assert s.requests["D"].num_computed_tokens == 36


def test_computed_tokens_advance_at_schedule_time() -> None:
    s = make_sched()
    s.add_request(make_req("A", 100))
    out = s.schedule()
    # Before any output returns, the chunk already counts as computed.
    assert s.requests["A"].num_computed_tokens == 64
    assert out.chunks() == [(s.requests["A"], 0, 64)]


def test_max_num_seqs_caps_running_requests() -> None:
    s = make_sched(max_num_seqs=2)
    for rid in "ABC":
        s.add_request(make_req(rid, 4, max_tokens=2))
    out, _ = run_step(s)
    assert list(ran(out)) == ["A", "B"]
    assert waiting_ids(s) == ["C"]
    out, res = run_step(s)
    assert list(ran(out)) == ["A", "B"]
    assert [r.request_id for r in res.finished] == ["A", "B"]
    # Their slots free up once they finish: C runs in the next step.
    out, _ = run_step(s)
    assert list(ran(out).items()) == [("C", 4)]
    assert len(s.running) == 1


def test_scheduling_never_exceeds_max_num_seqs_even_with_budget_left() -> None:
    s = make_sched(max_num_seqs=3)
    for k in range(10):
        s.add_request(make_req(f"r{k}", 2, max_tokens=4))
    while s.has_requests():
        out, _ = run_step(s)
        assert len(s.running) <= 3
        assert len(out.scheduled) <= 3


# ---- long_prefill_token_threshold -------------------------------------------


def test_threshold_caps_each_prefill_chunk() -> None:
    s = make_sched(long_prefill_token_threshold=8)
    s.add_request(make_req("A", 20))
    s.add_request(make_req("B", 20))
    chunks = []
    for _ in range(3):
        out, _ = run_step(s)
        chunks.append(ran(out))
    assert chunks == [{"A": 8, "B": 8}, {"A": 8, "B": 8}, {"A": 4, "B": 4}]


def test_threshold_ignored_for_a_lone_request() -> None:
    s = make_sched(long_prefill_token_threshold=8)
    s.add_request(make_req("A", 40))
    out, _ = run_step(s)
    assert ran(out) == {"A": 40}


def test_threshold_applies_again_once_a_second_request_exists() -> None:
    s = make_sched(long_prefill_token_threshold=8)
    s.add_request(make_req("A", 100))
    out, _ = run_step(s)
    assert ran(out) == {"A": 64}  # alone: only the budget limits it
    s.add_request(make_req("B", 30))
    out, _ = run_step(s)
    # A waiting request counts: now both are capped.
    assert ran(out) == {"A": 8, "B": 8}


def test_threshold_does_not_cap_decodes() -> None:
    s = make_sched(long_prefill_token_threshold=1)
    s.add_request(make_req("A", 4))
    s.add_request(make_req("B", 4))
    out, _ = run_step(s)
    assert ran(out) == {"A": 1, "B": 1}
    for _ in range(3):
        run_step(s)
    out, _ = run_step(s)
    assert ran(out) == {"A": 1, "B": 1}
    assert s.requests["A"].num_output_tokens == 2


# ---- chunked prefill off ------------------------------------------------------


def test_chunked_prefill_off_stops_admission_at_a_prompt_that_does_not_fit() -> None:
    s = make_sched(enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=64)
    s.add_request(make_req("A", 40))
    s.add_request(make_req("B", 30))
    s.add_request(make_req("C", 10))
    out, _ = run_step(s)
    # B needs 30 tokens but only 24 are left: admission stops there; C,
    # which would fit, is not considered (stop, not skip).
    assert ran(out) == {"A": 40}
    assert waiting_ids(s) == ["B", "C"]
    assert not s.requests["A"].is_prefill_chunk
    out, _ = run_step(s)
    assert list(ran(out).items()) == [("A", 1), ("B", 30), ("C", 10)]


def test_chunked_prefill_on_chunks_the_same_prompt() -> None:
    s = make_sched(max_model_len=64, max_num_batched_tokens=64)
    s.add_request(make_req("A", 40))
    s.add_request(make_req("B", 30))
    s.add_request(make_req("C", 10))
    out, _ = run_step(s)
    assert list(ran(out).items()) == [("A", 40), ("B", 24)]
    assert waiting_ids(s) == ["C"]


# ---- partial prefill chunks -----------------------------------------------------


def test_partial_prefill_chunk_samples_nothing() -> None:
    s = make_sched()
    s.add_request(make_req("A", 100))
    out, res = run_step(s)
    a = s.requests["A"]
    assert ran(out) == {"A": 64}
    assert a.is_prefill_chunk
    assert res.updated == [] and res.finished == []
    assert a.num_tokens == 100 and a.output_token_ids == []
    out, res = run_step(s)
    assert ran(out) == {"A": 36}
    assert not a.is_prefill_chunk
    assert res.updated == [a]
    assert a.output_token_ids == [7]


def test_update_rejects_a_result_of_the_wrong_length() -> None:
    s = make_sched()
    s.add_request(make_req("A", 8))
    s.add_request(make_req("B", 8))
    out = s.schedule()
    with pytest.raises(ValueError, match="2 scheduled"):
        s.update_from_output(out, ModelRunnerOutput([[7]]))


# ---- full-prompt reservation ----------------------------------------------------


def _reservation_scenario(reserve: bool) -> tuple[Scheduler, SchedulerOutput]:
    # 10 usable blocks of 4 tokens; A holds 5 after its first decode.
    s = make_sched(
        num_gpu_blocks=11,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        scheduler_reserve_full_isl=reserve,
    )
    s.add_request(make_req("A", 16, max_tokens=8))
    out, _ = run_step(s)
    assert ran(out) == {"A": 16}
    s.add_request(make_req("B", 28, max_tokens=1))  # 7 blocks for the whole prompt
    out, _ = run_step(s)
    return s, out


def test_full_prompt_reservation_requires_the_whole_prompt_to_fit() -> None:
    s, out = _reservation_scenario(reserve=True)
    # B's 15-token chunk would fit in the 5 free blocks, its 28-token prompt not.
    assert ran(out) == {"A": 1}
    assert waiting_ids(s) == ["B"]
    assert s.kv.num_free_blocks == 5
    assert s.kv.num_held_blocks("B") == 0


def test_without_full_prompt_reservation_the_chunk_is_enough() -> None:
    s, out = _reservation_scenario(reserve=False)
    assert ran(out) == {"A": 1, "B": 15}
    assert s.kv.num_held_blocks("B") == 4
    assert s.kv.num_free_blocks == 1


def test_reserved_request_is_admitted_once_blocks_free_up() -> None:
    s, _ = _reservation_scenario(reserve=True)
    admitted_at = None
    for k in range(20):
        out, _ = run_step(s)
        if out.admitted:
            admitted_at = k
            break
    assert admitted_at is not None
    assert [r.request_id for r in out.admitted] == ["B"]
    # A (8 tokens) finished and was reported in the very step B came in.
    assert out.finished_req_ids == ["A"]


# ---- watermark --------------------------------------------------------------------


def test_watermark_not_applied_while_nothing_runs() -> None:
    # 20 usable blocks, watermark int(0.1 * 21) = 2 blocks.
    s = make_sched(num_gpu_blocks=21, max_model_len=128, watermark=0.1)
    assert s.config.watermark_blocks == 2
    s.add_request(make_req("A", 76, max_tokens=2))  # 19 blocks: leaves 1 < 2 free
    out, _ = run_step(s)
    assert ran(out) == {"A": 64}
    assert running_ids(s) == ["A"]


@pytest.mark.parametrize(
    ("watermark", "admitted"),
    [(0.0, True), (0.05, True), (0.1, False)],
)
def test_watermark_keeps_blocks_free_when_admitting(watermark: float, admitted: bool) -> None:
    s = make_sched(num_gpu_blocks=21, max_model_len=128, watermark=watermark)
    s.add_request(make_req("A", 8, max_tokens=32))
    run_step(s)
    s.add_request(make_req("B", 64, max_tokens=1))  # 16 blocks
    out, _ = run_step(s)
    # A's decode holds 3 blocks: 17 free. B needs 16, leaving 1 free, which is
    # enough for a 1-block watermark (0.05 * 21) but not a 2-block one (0.1 * 21).
    assert ("B" in ran(out)) is admitted
    if admitted:
        assert ran(out)["B"] == 63
        assert s.kv.num_free_blocks == 1
    else:
        assert waiting_ids(s) == ["B"]
        assert s.kv.num_free_blocks == 17


@pytest.mark.parametrize(("watermark", "admitted"), [(0.0, True), (0.1, False)])
def test_watermark_applies_after_an_admission_in_the_same_step(watermark: float, admitted: bool) -> None:
    s = make_sched(num_gpu_blocks=21, max_model_len=128, watermark=watermark)
    s.add_request(make_req("A", 8, max_tokens=4))
    s.add_request(make_req("B", 68, max_tokens=1))  # 17 blocks for the whole prompt
    out, _ = run_step(s)
    # A came in while nothing ran; B follows A in the same step, so the
    # 2-block watermark applies to it: 18 free, 17 needed, 2 kept free.
    assert ("B" in ran(out)) is admitted
    assert ran(out)["A"] == 8


def test_watermark_does_not_limit_running_requests() -> None:
    s = make_sched(num_gpu_blocks=11, max_model_len=64, max_num_batched_tokens=16, watermark=0.5)
    assert s.config.watermark_blocks == 5
    s.add_request(make_req("A", 16, max_tokens=20))
    fewest_free = s.kv.num_free_blocks
    while "A" in s.requests:
        out, _ = run_step(s)
        assert out.preempted == []
        fewest_free = min(fewest_free, s.kv.num_free_blocks)
    # A grew to 9 of the 10 usable blocks, deep into the 5-block watermark.
    assert fewest_free == 1
    assert s.requests == {} and s.kv.num_free_blocks == 10


# ---- priority ordering ------------------------------------------------------------


def _mixed_priorities() -> list[Request]:
    return [
        make_req("p2", 4, priority=2, arrival_time=1.0),
        make_req("b", 4, priority=0, arrival_time=3.0),
        make_req("p1", 4, priority=1, arrival_time=2.0),
        make_req("early", 4, priority=0, arrival_time=2.0),
        make_req("a", 4, priority=0, arrival_time=3.0),
    ]


def test_priority_policy_admits_by_priority_then_arrival_then_id() -> None:
    s = make_sched(policy="priority")
    for r in _mixed_priorities():
        s.add_request(r)
    assert waiting_ids(s) == ["early", "a", "b", "p1", "p2"]
    out, _ = run_step(s)
    assert [r.request_id for r in out.admitted] == ["early", "a", "b", "p1", "p2"]


def test_fcfs_policy_ignores_priority() -> None:
    s = make_sched()
    for r in _mixed_priorities():
        s.add_request(r)
    out, _ = run_step(s)
    assert [r.request_id for r in out.admitted] == ["p2", "b", "p1", "early", "a"]


def test_priority_order_decides_who_gets_the_last_of_the_budget() -> None:
    s = make_sched(policy="priority", max_num_batched_tokens=16)
    s.add_request(make_req("low", 12, priority=5, arrival_time=1.0))
    s.add_request(make_req("high", 12, priority=0, arrival_time=2.0))
    out, _ = run_step(s)
    assert list(ran(out).items()) == [("high", 12), ("low", 4)]


def test_higher_priority_arrival_does_not_preempt_a_running_request() -> None:
    s = make_sched(policy="priority", max_num_seqs=1)
    s.add_request(make_req("low", 4, priority=5, arrival_time=1.0))
    run_step(s)
    s.add_request(make_req("high", 4, priority=0, arrival_time=2.0))
    out, _ = run_step(s)
    assert ran(out) == {"low": 1}
    assert out.preempted == []
    assert waiting_ids(s) == ["high"]


# ---- LoRA slots ---------------------------------------------------------------------


def _lora_requests() -> list[Request]:
    return [
        make_req("A", 4, max_tokens=2, lora_id=1),
        make_req("B", 4, max_tokens=2, lora_id=2),
        make_req("C", 4, max_tokens=2, lora_id=3),
        make_req("D", 4, max_tokens=2, lora_id=1),
        make_req("E", 4, max_tokens=2),
    ]


def test_max_loras_sets_aside_and_requeues_in_original_order() -> None:
    s = make_sched(max_loras=1)
    for r in _lora_requests():
        s.add_request(r)
    out, _ = run_step(s)
    # B and C would load a second adapter: set aside, not a stop, so D (same
    # adapter as A) and E (no adapter) still run.
    assert [r.request_id for r in out.admitted] == ["A", "D", "E"]
    assert waiting_ids(s) == ["B", "C"]
    out, res = run_step(s)
    assert {r.request_id for r in res.finished} == {"A", "D", "E"}
    assert out.admitted == []  # adapter 1 still loaded during this step
    out, _ = run_step(s)
    assert [r.request_id for r in out.admitted] == ["B"]
    assert waiting_ids(s) == ["C"]


def test_max_loras_two_slots() -> None:
    s = make_sched(max_loras=2)
    for r in _lora_requests():
        s.add_request(r)
    out, _ = run_step(s)
    assert [r.request_id for r in out.admitted] == ["A", "B", "D", "E"]
    assert waiting_ids(s) == ["C"]


def test_no_lora_limit_by_default() -> None:
    s = make_sched()
    for r in _lora_requests():
        s.add_request(r)
    out, _ = run_step(s)
    assert len(out.admitted) == 5


def test_set_aside_lora_requests_keep_their_place_ahead_of_later_arrivals() -> None:
    s = make_sched(max_loras=1, max_num_seqs=2)
    for r in _lora_requests():
        s.add_request(r)
    run_step(s)
    # max_num_seqs stops admission after A and D; B and C were set aside
    # before that and must still precede E.
    assert waiting_ids(s) == ["B", "C", "E"]


# ---- all requests complete --------------------------------------------------------------


def test_everything_finishes_and_each_request_gets_exactly_max_tokens() -> None:
    s = make_sched(max_num_batched_tokens=32, num_gpu_blocks=40, long_prefill_token_threshold=12)
    lengths = {f"r{k}": (5 + 7 * k, 3 + k) for k in range(8)}
    reqs = {rid: make_req(rid, p, max_tokens=m) for rid, (p, m) in lengths.items()}
    for r in reqs.values():
        s.add_request(r)
    for _ in range(500):
        if not s.has_requests():
            break
        run_step(s)
    assert not s.has_requests()
    for rid, (p, m) in lengths.items():
        r = reqs[rid]
        assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.num_output_tokens == m
        assert r.num_tokens == p + m


# ---- a policy that preempts for a waiting request --------------------------------


class _PreemptForNewcomers(FCFSPolicy):
    """FCFS's queue (preempted requests go back first); a waiting request may take a running one's slot."""

    decides_admission = True

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        return running[-1] if running else None


def test_a_victim_put_back_ahead_of_the_newcomer_does_not_take_its_admission() -> None:
    s = Scheduler(make_sched(max_num_seqs=1).config, policy=_PreemptForNewcomers())
    s.add_request(make_req("A", 8, max_tokens=4))
    run_step(s)
    s.add_request(make_req("B", 8, max_tokens=4))
    out, _ = run_step(s)
    # B takes A's slot; A waits at the head of the queue, as a preempted request does.
    assert [r.request_id for r in out.preempted] == ["A"]
    assert [r.request_id for r in out.admitted] == ["B"]
    assert running_ids(s) == ["B"] and waiting_ids(s) == ["A"]
    assert s.requests["A"].status is RequestStatus.PREEMPTED
    # Both finish; nothing is lost or left holding blocks.
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        run_step(s)
    assert not s.has_unfinished_requests()
    assert s.kv_usage == 0.0
