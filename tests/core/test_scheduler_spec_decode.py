"""Speculative decoding in the scheduler: draft scheduling, rollback of rejected drafts, lookahead."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import pytest

from llmsched.core import (
    ModelRunnerOutput,
    Request,
    RequestRejected,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
    StepOutputs,
)
from support.scheduling import make_sched as base_sched


def make_sched(**overrides: object) -> Scheduler:
    """The shared test scheduler (4-token blocks, invariants checked) with 3 draft tokens."""
    return base_sched(**{"num_speculative_tokens": 3, **overrides})


def make_req(rid: str, prompt_len: int, max_tokens: int = 32, **kwargs: object) -> Request:
    """A request whose prompt is unique to its id; EOS is ignored unless eos ids are given."""
    base = (zlib.crc32(rid.encode()) % 100_000) * 1_000
    params = SamplingParams(max_tokens=max_tokens, ignore_eos="eos_token_ids" not in kwargs)
    return Request(rid, [base + j for j in range(prompt_len)], params, **kwargs)


def update(
    sched: Scheduler,
    out: SchedulerOutput,
    sampled: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int]] | None = None,
) -> StepOutputs:
    """Feed the given sampled tokens (and drafts for next step) back to the scheduler."""
    return sched.update_from_output(out, ModelRunnerOutput(sampled, draft_token_ids=drafts))


def prefilled(sched: Scheduler, rids: Sequence[str], prompt_len: int, drafts: Sequence[int]) -> None:
    """Admit and fully prefill ``rids`` in one step, each getting ``drafts`` to verify next."""
    for rid in rids:
        sched.add_request(make_req(rid, prompt_len))
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled] == list(rids)
    assert all(not r.is_prefill_chunk for r in out.scheduled)
    update(sched, out, [[7]] * len(rids), [list(drafts)] * len(rids))


def test_drafts_from_output_are_kept_for_the_next_step() -> None:
    s = make_sched()
    prefilled(s, ["A"], 8, [1, 2, 3])
    a = s.requests["A"]
    assert a.spec_token_ids == [1, 2, 3]
    # Drafts count towards what the request wants, not its known tokens.
    assert a.num_tokens == 9


def test_drafts_are_scheduled_with_the_decode() -> None:
    s = make_sched()
    prefilled(s, ["A"], 8, [1, 2, 3])
    a = s.requests["A"]
    out = s.schedule()
    assert out.num_scheduled_tokens_by_id() == {"A": 4}
    assert out.spec_decode_tokens == {"A": [1, 2, 3]}
    assert a.num_computed_tokens == 12
    # Consumed: fresh drafts come with this step's output.
    assert a.spec_token_ids == []


def test_drafts_are_cut_to_the_token_budget() -> None:
    s = make_sched(max_num_batched_tokens=10, max_num_seqs=4)
    prefilled(s, ["A", "B", "C"], 3, [1, 2, 3])
    out = s.schedule()
    assert list(out.num_scheduled_tokens_by_id().items()) == [("A", 4), ("B", 4), ("C", 2)]
    assert out.spec_decode_tokens == {"A": [1, 2, 3], "B": [1, 2, 3], "C": [1]}
    assert out.total_num_scheduled_tokens == 10


def test_no_draft_slot_left_schedules_a_plain_decode() -> None:
    s = make_sched(max_num_batched_tokens=9, max_num_seqs=4)
    prefilled(s, ["A", "B", "C"], 3, [1, 2, 3])
    out = s.schedule()
    assert list(out.num_scheduled_tokens_by_id().items()) == [("A", 4), ("B", 4), ("C", 1)]
    assert "C" not in out.spec_decode_tokens
    assert s.requests["C"].spec_token_ids == []


@pytest.mark.parametrize(
    ("sampled", "computed", "num_tokens"),
    [
        ([9], 9, 10),  # every draft rejected: the bonus token only
        ([1, 9], 10, 11),  # one accepted
        ([1, 2, 9], 11, 12),
        ([1, 2, 3, 9], 12, 13),  # all accepted
    ],
)
def test_rejected_drafts_roll_computed_tokens_back(
    sampled: list[int], computed: int, num_tokens: int
) -> None:
    s = make_sched()
    prefilled(s, ["A"], 8, [1, 2, 3])
    a = s.requests["A"]
    out = s.schedule()
    assert a.num_computed_tokens == 12
    res = update(s, out, [sampled])
    assert res.updated == [a]
    assert a.num_computed_tokens == computed
    assert a.num_tokens == num_tokens
    assert a.output_token_ids == [7, *sampled]
    # Computed always trails the known tokens by exactly the newest one.
    assert a.num_computed_tokens == a.num_tokens - 1


def test_after_a_rejection_the_next_step_recomputes_from_the_rollback_point() -> None:
    s = make_sched()
    prefilled(s, ["A"], 8, [1, 2, 3])
    out = s.schedule()
    update(s, out, [[1, 9]], [[4, 5, 6]])
    out = s.schedule()
    assert out.chunks() == [(s.requests["A"], 10, 4)]
    assert out.spec_decode_tokens == {"A": [4, 5, 6]}


def test_without_new_drafts_the_next_step_is_a_plain_decode() -> None:
    s = make_sched()
    prefilled(s, ["A"], 8, [1, 2, 3])
    out = s.schedule()
    update(s, out, [[1, 2, 3, 9]])
    out = s.schedule()
    assert out.num_scheduled_tokens_by_id() == {"A": 1}
    assert out.spec_decode_tokens == {}


def test_drafts_ignored_for_prefill_chunks() -> None:
    s = make_sched()
    s.add_request(make_req("A", 100))
    out = s.schedule()
    a = s.requests["A"]
    assert a.is_prefill_chunk
    update(s, out, [[]], [[1, 2, 3]])
    assert a.spec_token_ids == []
    out = s.schedule()
    assert out.num_scheduled_tokens_by_id() == {"A": 36}
    assert out.spec_decode_tokens == {}


def test_drafts_with_the_last_prefill_chunk_are_used() -> None:
    s = make_sched()
    s.add_request(make_req("A", 100))
    update(s, s.schedule(), [[]])
    out = s.schedule()
    assert not s.requests["A"].is_prefill_chunk
    update(s, out, [[7]], [[1, 2, 3]])
    assert s.requests["A"].spec_token_ids == [1, 2, 3]


def test_drafts_are_cut_so_positions_stay_below_max_model_len() -> None:
    s = make_sched(max_model_len=32)
    s.add_request(make_req("A", 28, max_tokens=4))
    update(s, s.schedule(), [[7]], [[1, 2, 3]])
    out = s.schedule()
    # computed 28, 1 known + 3 drafts wanted, but position 31 is the last
    # one below max_model_len: 3 tokens, 2 of them drafts.
    assert out.num_scheduled_tokens_by_id() == {"A": 3}
    assert out.spec_decode_tokens == {"A": [1, 2]}
    res = update(s, out, [[1, 2, 9]])
    a = res.finished[0]
    assert a.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.num_tokens == 32


def test_stop_token_among_accepted_drafts_drops_the_rest() -> None:
    s = make_sched()
    s.add_request(make_req("A", 8, eos_token_ids=[2]))
    update(s, s.schedule(), [[7]], [[1, 2, 3]])
    a = s.requests["A"]
    out = s.schedule()
    res = update(s, out, [[1, 2, 5]])
    assert res.finished == [a]
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids == [7, 1, 2]
    assert a.num_computed_tokens == a.num_tokens - 1
    assert s.kv.num_free_blocks == 256


def test_max_tokens_reached_among_accepted_drafts() -> None:
    s = make_sched()
    s.add_request(make_req("A", 8, max_tokens=3))
    update(s, s.schedule(), [[7]], [[1, 2, 3]])
    a = s.requests["A"]
    res = update(s, s.schedule(), [[1, 2, 3, 9]])
    assert res.finished == [a]
    assert a.output_token_ids == [7, 1, 2]
    assert a.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_lookahead_slots_allocated_at_admission_and_decode() -> None:
    plain = make_sched(num_speculative_tokens=0)
    ahead = make_sched(num_speculative_tokens=0, num_lookahead_tokens=4)
    for s in (plain, ahead):
        s.add_request(make_req("A", 8))
    out_plain, out_ahead = plain.schedule(), ahead.schedule()
    # 8 tokens: 2 blocks; with 4 lookahead slots 12 positions: 3 blocks.
    assert [len(b) for b in out_plain.admitted_block_ids] == [2]
    assert [len(b) for b in out_ahead.admitted_block_ids] == [3]
    for s, out in ((plain, out_plain), (ahead, out_ahead)):
        update(s, out, [[7]])
    out_plain, out_ahead = plain.schedule(), ahead.schedule()
    # Decode of position 8: 9 slots need a 3rd block; 13 with lookahead a 4th.
    assert len(out_plain.new_block_ids["A"]) == 1
    assert len(out_ahead.new_block_ids["A"]) == 1
    assert plain.kv.num_held_blocks("A") == 3
    assert ahead.kv.num_held_blocks("A") == 4


def test_lookahead_slots_do_not_count_as_scheduled_tokens() -> None:
    s = make_sched(num_speculative_tokens=0, num_lookahead_tokens=4)
    s.add_request(make_req("A", 8))
    out = s.schedule()
    assert out.total_num_scheduled_tokens == 8
    assert s.requests["A"].num_computed_tokens == 8


def test_add_request_counts_lookahead_slots_and_drafts_from_a_block_on() -> None:
    # 4 usable blocks = 16 slots. 8 + 8 tokens needs 15 slots (the last
    # sampled token is never computed): fits; with 2 lookahead slots, 17 do not.
    fits = make_sched(num_gpu_blocks=5, num_speculative_tokens=0)
    fits.add_request(make_req("A", 8, max_tokens=8))
    # Drafts count only when they and the lookahead reach a block (4 slots):
    # a padded resume after a hit of all but one token needs them.
    for spec, ahead in ((0, 2), (4, 0), (2, 2)):
        s = make_sched(num_gpu_blocks=5, num_speculative_tokens=spec, num_lookahead_tokens=ahead)
        with pytest.raises(RequestRejected, match="KV blocks"):
            s.add_request(make_req("A", 8, max_tokens=8))
        assert len(s.waiting) == 0 and s.requests == {}


def test_drafts_past_the_cache_preempt_the_request_which_finishes_without_them() -> None:
    # 15 slots fit the 16 of the cache; 3 drafts past them do not. vLLM runs
    # such a request: the step that cannot hold its drafts preempts it, which
    # drops them, and it resumes without.
    s = make_sched(num_gpu_blocks=5, num_speculative_tokens=3)
    s.add_request(make_req("A", 8, max_tokens=8))
    a = s.requests["A"]
    preempted = False
    for _ in range(40):
        out = s.schedule()
        preempted = preempted or a in out.preempted
        # Every draft rejected: one token a step.
        sampled = [[7] if r.num_computed_tokens >= r.num_tokens else [] for r in out.scheduled]
        if update(s, out, sampled, [[1, 2, 3]] * len(sampled)).finished:
            break
    assert preempted
    assert a.status is RequestStatus.FINISHED_LENGTH_CAPPED and len(a.output_token_ids) == 8


def test_priority_victim_scheduled_with_drafts_loses_them() -> None:
    # X (low priority) runs first in running order; each step both get two
    # drafts, all rejected. In the 4th step after Y joins, X is scheduled with
    # its drafts, then Y needs a block and none is free: X is the victim.
    s = make_sched(num_gpu_blocks=8, max_model_len=64, policy="priority", num_speculative_tokens=2)
    s.add_request(make_req("X", 8, max_tokens=16, priority=9, arrival_time=1.0))
    update(s, s.schedule(), [[7]], [[1, 2]])
    s.add_request(make_req("Y", 8, max_tokens=16, priority=0, arrival_time=2.0))
    for _ in range(3):
        out = s.schedule()
        assert out.preempted == []
        sampled = [[7] if r.num_computed_tokens >= r.num_tokens else [] for r in out.scheduled]
        update(s, out, sampled, [[1, 2]] * len(sampled))
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["X"]
    assert out.num_scheduled_tokens_by_id() == {"Y": 3}
    assert out.spec_decode_tokens == {"Y": [1, 2]}
    assert out.total_num_scheduled_tokens == 3
    assert s.requests["X"].spec_token_ids == []


def _same_prompt(rid: str, prompt: Sequence[int], max_tokens: int = 16) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_one_token_admission_beside_decodes_is_padded_to_a_draft_step() -> None:
    """vLLM pads an admission with one token left (full prefix hit) to 1 + K with placeholder drafts."""
    s = make_sched()
    prompt = list(range(100, 109))  # 9 tokens: a copy hits 8, leaving 1
    s.add_request(_same_prompt("A", prompt))
    update(s, s.schedule(), [[7]], [[]])
    s.add_request(_same_prompt("B", prompt))
    out = s.schedule()
    assert out.num_scheduled_tokens_by_id() == {"A": 1, "B": 4}
    assert out.admitted_num_cached_tokens == [8]
    assert out.spec_decode_tokens == {"B": [-1, -1, -1]}
    # The padding is rejected: B ends where an unpadded admission would.
    update(s, out, [[7], [7]])
    assert s.requests["B"].num_computed_tokens == s.requests["B"].num_tokens - 1 == 9


def test_no_padding_while_a_prefill_runs_or_for_a_first_token_alone() -> None:
    s = make_sched()
    s.add_request(_same_prompt("P", [5]))
    out = s.schedule()
    # Nothing else ran and nothing was cached: a lone one-token prompt is not padded.
    assert out.num_scheduled_tokens_by_id() == {"P": 1} and out.spec_decode_tokens == {}
    s2 = make_sched(long_prefill_token_threshold=4)
    prompt = list(range(100, 109))
    s2.add_request(_same_prompt("A", prompt))
    update(s2, s2.schedule(), [[7]], [[]])
    s2.add_request(make_req("L", 20))
    update(s2, s2.schedule(), [[7], []])  # L prefills 4 of 20
    s2.add_request(_same_prompt("B", prompt))
    out = s2.schedule()
    # L's prefill continues in this step, so B is admitted with its one token only.
    assert out.num_scheduled_tokens_by_id() == {"A": 1, "L": 4, "B": 1}
    assert out.spec_decode_tokens == {}


def test_no_padding_where_a_padded_step_could_never_be_scheduled() -> None:
    """A budget below 1 + K (or a threshold that would cut the step) admits the one token unpadded."""
    prompt = list(range(100, 109))
    for overrides in ({"max_num_batched_tokens": 3, "max_num_seqs": 2}, {"long_prefill_token_threshold": 2}):
        s = make_sched(**overrides)
        s.add_request(_same_prompt("A", prompt))
        for _ in range(5):
            out = s.schedule()
            update(s, out, [[7]] if not out.scheduled[0].is_prefill_chunk else [[]], [[]])
        s.add_request(_same_prompt("B", prompt))
        out = s.schedule()
        assert out.num_scheduled_tokens_by_id() == {"A": 1, "B": 1}, overrides
        assert out.spec_decode_tokens == {}
