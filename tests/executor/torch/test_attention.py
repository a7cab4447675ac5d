"""PagedAttention against a dense per-request reference, for mixed decode / prefill batches."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmsched.core import Request, SamplingParams, SchedulerOutput
from llmsched.executor.torch.attention import AttentionMetadata, PagedAttention, PrefillChunk, fresh_runs
from llmsched.executor.torch.input_batch import InputBatch, plan_step
from llmsched.executor.torch.kv_cache import key_view

BS = 4
D = 8
NB = 96


def make_batch(keys_transposed: bool, group_bytes: int, kvh: int) -> InputBatch:
    return InputBatch(
        block_size=BS,
        max_blocks_per_request=32,
        max_num_seqs=8,
        device=torch.device("cpu"),
        decode_group_bytes=group_bytes,
        kv_row_bytes=kvh * D * 4,
        keys_transposed=keys_transposed,
        dtype=torch.float32,
    )


# (context already in the cache, tokens this step): decodes, a fresh prefill,
# prefills continuing after a prefix hit / an earlier chunk.
CHUNKS = [(9, 1), (0, 6), (22, 1), (3, 1), (6, 7), (13, 1), (40, 1), (17, 5), (1, 1)]
# A decode-only step (in one group, its output bags are the whole output).
DECODES = [c for c in CHUNKS if c[1] == 1]


@pytest.mark.parametrize("chunks", [CHUNKS, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (6, 1)])
@pytest.mark.parametrize("keys_transposed", [True, False])
@pytest.mark.parametrize("group_bytes", [1, 1 << 20])
def test_matches_dense_reference(heads, keys_transposed, group_bytes, chunks):
    nh, kvh = heads
    g = torch.Generator().manual_seed(sum(heads) + group_bytes % 7)
    cache = torch.zeros(2, kvh, NB, BS, D)
    key_cache, value_cache = key_view(cache, keys_transposed), cache[1].permute(1, 2, 0, 3)
    free = torch.randperm(NB - 1, generator=g).add(1).tolist()
    so = SchedulerOutput(step=0)
    dense_k, dense_v = [], []
    for i, (ctx, n) in enumerate(chunks):
        total = ctx + n
        req = Request(str(i), list(range(total)), SamplingParams(max_tokens=4))
        req.num_computed_tokens = total
        blocks = [free.pop() for _ in range(math.ceil(total / BS))]
        so.scheduled.append(req)
        so.num_scheduled_tokens.append(n)
        so.admitted.append(req)
        so.admitted_block_ids.append(blocks)
        k = torch.randn(total, kvh, D, generator=g)
        v = torch.randn(total, kvh, D, generator=g)
        for p in range(ctx):  # earlier steps' KV
            key_cache[blocks[p // BS], p % BS] = k[p]
            value_cache[blocks[p // BS], p % BS] = v[p]
        dense_k.append(k)
        dense_v.append(v)
    batch = make_batch(keys_transposed, group_bytes, kvh)
    batch.update(plan_step(so))
    step = batch.prepare(plan_step(so))
    meta = step.attn
    if group_bytes == 1:
        assert len(meta.decode_groups) == sum(1 for _, n in chunks if n == 1)
    else:
        assert len(meta.decode_groups) == 1
    # Which request and position each flattened row is.
    owner = []
    for i, (ctx, n) in enumerate(chunks):
        owner += [(i, p) for p in range(ctx, ctx + n)]
    by_slot = {}
    for i, p in owner:
        blocks = so.admitted_block_ids[i]
        by_slot[blocks[p // BS] * BS + p % BS] = (i, p)
    rows = [by_slot[s] for s in meta.slot_mapping.tolist()]
    assert sorted(rows) == sorted(owner)
    assert step.positions.tolist() == [p for _, p in rows]
    q = torch.randn(len(rows), nh, D, generator=g)
    k_new = torch.stack([dense_k[i][p] for i, p in rows])
    v_new = torch.stack([dense_v[i][p] for i, p in rows])
    attn = PagedAttention(nh, kvh, D, BS, keys_transposed)
    out = attn.forward(q, k_new, v_new, cache, meta).view(len(rows), nh, D)
    grp = nh // kvh
    for r, (i, p) in enumerate(rows):
        keys = dense_k[i][: p + 1]
        vals = dense_v[i][: p + 1]
        for h in range(nh):
            w = torch.softmax(keys[:, h // grp] @ q[r, h] / math.sqrt(D), 0)
            ref = w @ vals[:, h // grp]
            assert torch.allclose(out[r, h], ref, atol=1e-5), (i, p, h)
    # New K/V landed in the cache at their slots; the null block stayed zero.
    for r, (i, p) in enumerate(rows):
        blocks = so.admitted_block_ids[i]
        assert torch.equal(key_cache[blocks[p // BS], p % BS], k_new[r])
        assert torch.equal(value_cache[blocks[p // BS], p % BS], v_new[r])
    assert not key_cache[0].any() and not value_cache[0].any()


def test_bfloat16_decode_is_close_to_float32():
    nh, kvh = 4, 2
    g = torch.Generator().manual_seed(3)
    attn = PagedAttention(nh, kvh, D, BS, keys_transposed=True)
    so = SchedulerOutput(step=0)
    req = Request("a", list(range(30)), SamplingParams())
    req.num_computed_tokens = 30
    so.scheduled.append(req)
    so.num_scheduled_tokens.append(1)
    so.admitted.append(req)
    so.admitted_block_ids.append(list(range(1, 9)))
    batch = make_batch(True, 1 << 20, kvh)
    batch.update(plan_step(so))
    meta = batch.prepare(plan_step(so)).attn
    cache = torch.randn(2, kvh, NB, BS, D, generator=g)
    q = torch.randn(1, nh, D, generator=g)
    k = torch.randn(1, kvh, D, generator=g)
    v = torch.randn(1, kvh, D, generator=g)
    exact = attn.forward(q, k, v, cache.clone(), meta)
    batch.dtype = torch.bfloat16
    meta = batch.prepare(plan_step(so)).attn
    half = attn.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16(), meta)
    assert half.dtype is torch.bfloat16
    assert torch.allclose(half.float(), exact, atol=0.05)


def test_fresh_runs_join_adjacent_equal_length_chunks_from_position_0():
    chunks = [PrefillChunk(s, e, 0) for s, e in [(2, 7), (7, 12), (12, 15), (15, 18), (18, 21)]]
    later = PrefillChunk(21, 24, 5, block_ids=torch.zeros(2, dtype=torch.int64))
    chunks += [later, PrefillChunk(24, 27, 0), PrefillChunk(30, 33, 0)]
    assert fresh_runs(chunks) == [(2, 12, 2), (12, 21, 3), (24, 27, 1), (30, 33, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(16, 16, 16), (16, 16, 9, 9, 9, 23)])
def test_batched_fresh_prefills_give_each_chunk_its_own_calls_bits(dtype, lengths):
    nh, kvh = 6, 2
    g = torch.Generator().manual_seed(len(lengths))
    ntok = sum(lengths)
    q = torch.randn(ntok, nh, D, generator=g).to(dtype)
    k = torch.randn(ntok, kvh, D, generator=g).to(dtype)
    v = torch.randn(ntok, kvh, D, generator=g).to(dtype)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(ntok), prefills=[PrefillChunk(s, s + n, 0) for s, n in zip(starts, lengths)]
    )
    cache = torch.zeros(2, kvh, NB, BS, D, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # chunks are batched on one thread only
    try:
        out = PagedAttention(nh, kvh, D, BS, keys_transposed=False).forward(q, k, v, cache, meta)
        refs = [
            F.scaled_dot_product_attention(
                *(t[s : s + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                is_causal=True,
                scale=D**-0.5,
                enable_gqa=True,
            )[0].transpose(0, 1)
            for s, n in zip(starts, lengths)
        ]
    finally:
        torch.set_num_threads(threads)
    for s, n, ref in zip(starts, lengths, refs):
        assert torch.equal(out[s : s + n].view(n, nh, D), ref)
    # The step's new K/V still land in the cache.
    assert torch.equal(cache[1].view(kvh, -1, D)[:, :ntok], v.transpose(0, 1))
