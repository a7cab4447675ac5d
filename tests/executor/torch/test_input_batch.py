"""Per-request executor state and the flattening of a step's chunks."""

from __future__ import annotations

import pytest
import torch

from llmsched.core import Request, SamplingParams, SchedulerOutput
from llmsched.executor.torch.input_batch import InputBatch, plan_step

BS = 4
CPU = torch.device("cpu")


def batch(max_num_seqs: int = 4) -> InputBatch:
    return InputBatch(
        block_size=BS,
        max_blocks_per_request=8,
        max_num_seqs=max_num_seqs,
        device=torch.device("cpu"),
        decode_group_bytes=1 << 20,
        kv_row_bytes=64,
        keys_transposed=True,
        dtype=torch.float32,
    )


def req(rid: str, n: int, computed: int) -> Request:
    """A request of n known tokens, computed up to ``computed`` as the scheduler leaves it."""
    r = Request(rid, [100 + i for i in range(n)], SamplingParams(max_tokens=8))
    r.num_computed_tokens = computed
    r.is_prefill_chunk = computed < n
    return r


def admit(so: SchedulerOutput, r: Request, blocks: list[int], n: int) -> None:
    so.scheduled.append(r)
    so.num_scheduled_tokens.append(n)
    so.admitted.append(r)
    so.admitted_block_ids.append(blocks)


def test_admission_growth_and_release():
    b = batch()
    a, c = req("a", 6, 6), req("c", 3, 3)
    so = SchedulerOutput(step=0)
    admit(so, a, [5, 9], 6)
    admit(so, c, [7], 3)
    b.update(plan_step(so))
    ra, rc = b.states["a"].row, b.states["c"].row
    assert b.block_table[ra, :3].tolist() == [5, 9, 0]
    assert b.block_table[rc, :2].tolist() == [7, 0]
    so = SchedulerOutput(step=1, new_block_ids={"c": [11, 12]})
    b.update(plan_step(so))
    assert b.states["c"].num_blocks == 3
    assert b.block_table[rc, :4].tolist() == [7, 11, 12, 0]
    # Finished: its row is zeroed and reused.
    b.update(plan_step(SchedulerOutput(step=2, finished_req_ids=["a"])))
    assert "a" not in b.states
    assert not b.block_table[ra].any()
    so = SchedulerOutput(step=3)
    admit(so, req("d", 2, 2), [3], 2)
    b.update(plan_step(so))
    assert b.states["d"].row == ra


def test_preempted_state_is_dropped_and_resumed_fresh():
    b = batch()
    a = req("a", 6, 6)
    so = SchedulerOutput(step=0)
    admit(so, a, [5, 9], 6)
    b.update(plan_step(so))
    b.update(plan_step(SchedulerOutput(step=1, preempted=[a])))
    assert b.states == {}
    so = SchedulerOutput(step=2)
    admit(so, a, [2, 3], 6)
    b.update(plan_step(so))
    assert b.block_table[b.states["a"].row, :2].tolist() == [2, 3]


def test_same_id_finished_and_readmitted_in_one_step():
    b = batch()
    so = SchedulerOutput(step=0)
    admit(so, req("a", 6, 6), [5, 9], 6)
    b.update(plan_step(so))
    so = SchedulerOutput(step=1, finished_req_ids=["a"])
    admit(so, req("a", 3, 3), [4], 3)
    b.update(plan_step(so))
    st = b.states["a"]
    assert st.num_blocks == 1
    assert b.block_table[st.row, :2].tolist() == [4, 0]


def test_more_requests_than_rows_grow_the_table():
    b = batch(max_num_seqs=2)
    so = SchedulerOutput(step=0)
    for i in range(5):
        admit(so, req(str(i), 3, 3), [i + 1], 3)
    b.update(plan_step(so))
    assert b.block_table.shape[0] == 8
    assert sorted(st.row for st in b.states.values()) == [0, 1, 2, 3, 4]
    assert [b.block_table[b.states[str(i)].row, 0].item() for i in range(5)] == [1, 2, 3, 4, 5]


def test_inconsistent_outputs_are_refused():
    b = batch()
    with pytest.raises(KeyError, match="never saw admitted"):
        b.update(plan_step(SchedulerOutput(step=0, new_block_ids={"ghost": [3]})))
    so = SchedulerOutput(step=0)
    admit(so, req("a", 40, 40), list(range(1, 11)), 40)
    with pytest.raises(ValueError, match="more than max_model_len allows"):
        b.update(plan_step(so))
    so = SchedulerOutput(step=0)
    r = req("b", 9, 9)
    so.scheduled.append(r)
    so.num_scheduled_tokens.append(9)
    with pytest.raises(KeyError, match="never admitted"):
        b.prepare(plan_step(so))
    so = SchedulerOutput(step=0)
    admit(so, r, [1, 2], 9)  # 9 tokens need 3 blocks
    b.update(plan_step(so))
    with pytest.raises(ValueError, match="holds only 2 blocks"):
        b.prepare(plan_step(so))


def test_prepare_orders_decodes_first_and_maps_samples_back():
    b = batch()
    so = SchedulerOutput(step=0)
    # A partial chunk, a long decode, a finishing chunk, a short decode.
    partial = req("p", 10, 6)  # positions 2..5 of 10: samples nothing
    long_dec = req("L", 9, 9)
    finishing = req("f", 7, 7)  # positions 4..6 of 7: samples
    short_dec = req("s", 3, 3)
    admit(so, partial, [1, 2], 4)
    admit(so, long_dec, [3, 4, 5], 1)
    admit(so, finishing, [6, 7], 3)
    admit(so, short_dec, [8], 1)
    b.update(plan_step(so))
    step = b.prepare(plan_step(so))
    # Decodes first, shorter context first; then prefill chunks in schedule order.
    assert step.positions.tolist() == [2, 8, 2, 3, 4, 5, 4, 5, 6]
    assert step.input_ids(CPU).tolist() == [102, 108, 102, 103, 104, 105, 104, 105, 106]
    assert step.attn.slot_mapping.tolist() == [
        8 * BS + 2,
        5 * BS + 0,
        1 * BS + 2,
        1 * BS + 3,
        2 * BS + 0,
        2 * BS + 1,
        7 * BS + 0,
        7 * BS + 1,
        7 * BS + 2,
    ]
    assert step.logits_indices.tolist() == [0, 1, 8]
    assert step.sample_sched_index == [3, 1, 2]
    assert [st.request.request_id for st in step.sample_states] == ["s", "L", "f"]
    (group,) = step.attn.decode_groups
    assert (group.start, group.end) == (0, 2)
    assert group.block_table.view(2, -1).tolist() == [[8, 0, 0], [3, 4, 5]]
    # One additive mask row per request, broadcast over KV heads and queries.
    assert group.mask.shape == (1, 2, 1, 12)
    visible = group.mask.view(2, 12) == 0
    assert visible.sum(1).tolist() == [3, 9]
    assert step.attn.num_decodes == 2
    chunks = step.attn.prefills
    assert [(c.start, c.end, c.context_start) for c in chunks] == [(2, 6, 2), (6, 9, 4)]
    assert chunks[0].block_ids.tolist() == [1, 2]
    assert chunks[0].mask.shape == (4, 8)
    assert chunks[0].mask.sum(1).tolist() == [3, 4, 5, 6]


def test_speculative_drafts_are_refused():
    b = batch()
    with pytest.raises(NotImplementedError, match="speculative"):
        b.prepare(plan_step(SchedulerOutput(step=0, spec_decode_tokens={"a": [1]})))


def test_recompute_from_grows_the_chunk_back_over_unwritten_blocks():
    b = batch()
    so = SchedulerOutput(step=0)
    # "c": 8 of 14 tokens hit, chunk 8..11 scheduled, the hit's block 4..7 unwritten.
    chunk = req("c", 14, 12)
    # "d": a 9-token prompt hit for 8, so one token scheduled; recompute from 4.
    one = req("d", 9, 9)
    # "z": a hit whose every block is unwritten: recompute from 0.
    zero = req("z", 6, 6)
    # "k": recompute_from at the chunk start changes nothing.
    kept = req("k", 5, 5)
    admit(so, chunk, [5, 6, 7, 8], 4)
    admit(so, one, [1, 2, 3], 1)
    admit(so, zero, [9, 10], 2)
    admit(so, kept, [11, 12], 1)
    so.recompute_from = {"c": 4, "d": 4, "z": 0, "k": 4}
    b.update(plan_step(so))
    step = b.prepare(plan_step(so))
    # Only "k" stays a decode; the others are prefills from their recompute position.
    assert step.attn.num_decodes == 1
    assert step.positions.tolist() == [4, *range(4, 12), *range(4, 9), *range(6)]
    assert step.input_ids(CPU).tolist() == [104, *range(104, 112), *range(104, 109), *range(100, 106)]
    assert step.attn.slot_mapping.tolist() == [
        12 * BS + 0,
        *[6 * BS + k for k in range(4)],
        *[7 * BS + k for k in range(4)],
        *[2 * BS + k for k in range(4)],
        3 * BS + 0,
        *[9 * BS + k for k in range(4)],
        10 * BS + 0,
        10 * BS + 1,
    ]
    chunks = step.attn.prefills
    assert [(c.start, c.end, c.context_start) for c in chunks] == [(1, 9, 4), (9, 14, 4), (14, 20, 0)]
    # Grown chunks still attend to the written prefix before them.
    assert chunks[0].block_ids.tolist() == [5, 6, 7]
    assert chunks[0].mask.sum(1).tolist() == list(range(5, 13))
    assert chunks[1].block_ids.tolist() == [1, 2, 3]
    assert chunks[2].block_ids is None
    # "c" ends short of its prompt: it samples nothing; the others sample their last row.
    assert step.logits_indices.tolist() == [0, 13, 19]
    assert [st.request.request_id for st in step.sample_states] == ["k", "d", "z"]
    assert step.sample_sched_index == [3, 1, 2]


def test_a_decode_of_a_token_still_being_sampled_is_filled_in_later():
    """Async scheduling: the input of a decode planned before the previous step returned."""
    b = batch()
    so = SchedulerOutput(step=0)
    first = req("a", 5, 5)
    admit(so, first, [1, 2], 5)
    b.update(plan_step(so))
    b.prepare(plan_step(so))
    # The engine plans the next step before the prefill's token is applied:
    # position 5 is beyond the request's 5 known tokens.
    first.num_computed_tokens = 6
    so2 = SchedulerOutput(step=1, scheduled=[first], num_scheduled_tokens=[1])
    b.update(plan_step(so2))
    step = b.prepare(plan_step(so2))
    assert [(row, pos) for row, _, pos in step.holes] == [(0, 5)]
    # The executor's own sample lands before the forward reads it.
    b.states["a"].generated.append(42)
    assert step.input_ids(CPU).tolist() == [42]
    assert step.positions.tolist() == [5]
    # Applying the token to the Request changes nothing the step reads.
    first.append_output_token(42)
    assert step.input_ids(CPU).tolist() == [42]


def test_chunk_block_ids_do_not_alias_the_block_table():
    """The next step's update may drop and reuse a table row while this step runs."""
    b = batch()
    so = SchedulerOutput(step=0)
    r = req("c", 9, 9)
    admit(so, r, [3, 4, 5], 4)
    b.update(plan_step(so))
    step = b.prepare(plan_step(so))
    (chunk,) = step.attn.prefills
    b.update(plan_step(SchedulerOutput(step=1, finished_req_ids=["c"])))
    assert chunk.block_ids.tolist() == [3, 4, 5]
