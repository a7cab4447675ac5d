"""The float32 C prefill attention kernel: as close to exact attention as PyTorch's float32 SDPA, and the same
bits for a query however its chunk is cut or threaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmsched.executor.torch import kernels
from llmsched.executor.torch.attention import AttentionMetadata, PagedAttention, PrefillChunk

from ..conftest import greedy, prompts_of, run_engine

KERNEL = kernels.prefill_attention_f32()


@pytest.fixture(autouse=True)
def _needs_avx2(kernels_built: None) -> None:
    """With the library built, the kernel is missing only on a CPU without AVX2 and FMA."""
    if KERNEL is None:
        pytest.skip("this CPU lacks AVX2 and FMA, which the float32 prefill kernel needs")


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's attention [lq, heads, d], query i seeing keys 0..lk-lq+i."""
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o[0].transpose(0, 1)


def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype)
    KERNEL.attend(q, k, v, q.shape[-1] ** -0.5, out)
    return out


def inputs(lq: int, lk: int, heads: int, kv_heads: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as slices of one fused projection (strided rows), float32."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(lk, heads + 2 * kv_heads, d, generator=g) * 2
    return qkv[lk - lq :, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]


SHAPES = [
    # (lq, lk, heads, kv_heads, head_dim): SmolLM2's 9 heads on 3 KV heads, tiles
    # (24 rows) cut mid-token, key blocks (256) crossed, lq < lk (cached context).
    (1, 1, 2, 1, 64),
    (5, 5, 4, 2, 16),
    (17, 17, 9, 3, 64),
    (16, 40, 4, 4, 32),
    (300, 300, 9, 3, 64),
    (100, 300, 8, 2, 128),
    (300, 700, 2, 2, 48),
    (40, 600, 16, 1, 256),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_as_close_to_exact_attention_as_pytorchs_float32_sdpa(shape):
    q, k, v = inputs(*shape, seed=sum(shape))
    exact = causal_sdpa(q.double(), k.double(), v.double())
    ours = (kernel(q, k, v).double() - exact).abs()
    torchs = (causal_sdpa(q, k, v).double() - exact).abs()
    # Both round scores, probabilities and sums to float32 in their own
    # orders: within twice PyTorch's error, on average and at worst.
    assert ours.mean() <= 2 * torchs.mean() + 1e-7
    assert ours.max() <= 2 * torchs.max() + 1e-6


def test_a_query_gets_the_same_bits_however_the_chunk_is_cut_or_threaded():
    q, k, v = inputs(600, 600, 9, 3, 64, seed=7)
    whole = kernel(q, k, v)
    # Rows 100.. as a later chunk over the same context (a prefix-cache hit or
    # chunked prefill), and as chunks of other lengths (tiles cut elsewhere).
    assert torch.equal(kernel(q[100:], k, v), whole[100:])
    assert torch.equal(kernel(q[:37], k[:37], v[:37]), whole[:37])
    assert torch.equal(kernel(q[257:531], k[:531], v[:531]), whole[257:531])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(kernel(q, k, v), whole)
    finally:
        torch.set_num_threads(threads)


def test_a_row_that_is_exactly_one_key_copies_its_value():
    q, k, v = inputs(1, 1, 4, 2, 64, seed=3)
    assert torch.equal(kernel(q, k, v), v.repeat_interleave(2, dim=1))


def test_rows_whose_head_dim_values_are_strided_are_refused():
    q, k, v = inputs(8, 8, 4, 2, 64, seed=1)
    keys = k.transpose(0, 2).contiguous().transpose(0, 2)  # the same values, head_dim strided
    with pytest.raises(
        ValueError, match=r"k must be torch\.float32 with each row's head_dim values contiguous"
    ):
        kernel(q, keys, v)
    with pytest.raises(ValueError, match=r"q must be torch\.float32"):
        kernel(q.double(), k, v)


def test_supports_float32_with_head_dims_in_16s_only():
    assert KERNEL.supports(torch.float32, 16) and KERNEL.supports(torch.float32, 64)
    assert not KERNEL.supports(torch.float32, 24) and not KERNEL.supports(torch.bfloat16, 64)
    assert not KERNEL.supports(torch.float32, KERNEL.max_head_dim + 16)
    assert PagedAttention(9, 3, 64, 16, keys_transposed=True).prefill_kernel_f32 is not None
    assert PagedAttention(4, 2, 24, 16, keys_transposed=True).prefill_kernel_f32 is None
    assert PagedAttention(4, 2, 64, 16, keys_transposed=False).prefill_kernel_f32 is None


@pytest.mark.parametrize("bs", [16, 128], ids=["blocks", "one-block-contexts"])
def test_paged_attention_runs_fresh_and_cached_float32_chunks_through_the_kernel(bs):
    """A fresh chunk, one after 40 cached tokens and another fresh one in a step: each the kernel's.

    With 128-token blocks each context fits one block, whose gathered K
    comes back as a transposed view.
    """
    heads, kv_heads, d, num_blocks = 9, 3, 64, 32
    g = torch.Generator().manual_seed(5)
    cache = torch.zeros(2, kv_heads, num_blocks, bs, d)
    keys = cache[0].view(kv_heads, num_blocks, d, bs)  # K blocks are stored transposed
    prefills, slots, new_k, new_v, contexts = [], [], [], [], []
    for start, n in [(0, 23), (40, 17), (0, 30)]:
        ctx_k, ctx_v = (torch.randn(start + n, kv_heads, d, generator=g) for _ in range(2))
        first = sum(-(-(s + m) // bs) for s, m, _, _ in contexts)
        blocks = torch.arange(first, first + -(-(start + n) // bs))
        for pos in range(start):
            keys[:, blocks[pos // bs], :, pos % bs] = ctx_k[pos]
            cache[1, :, blocks[pos // bs], pos % bs] = ctx_v[pos]
        rows = len(slots)
        slots += [int(blocks[p // bs]) * bs + p % bs for p in range(start, start + n)]
        prefills.append(PrefillChunk(rows, rows + n, start, block_ids=blocks if start else None))
        new_k.append(ctx_k[start:])
        new_v.append(ctx_v[start:])
        contexts.append((start, n, ctx_k, ctx_v))
    q = torch.randn(len(slots), heads, d, generator=g)
    slot_mapping = torch.tensor(slots)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        prefills=prefills,
        slot_blocks=slot_mapping // bs,
        slot_offsets=slot_mapping % bs,
    )
    attn = PagedAttention(heads, kv_heads, d, bs, keys_transposed=True)
    out = attn.forward(q, torch.cat(new_k), torch.cat(new_v), cache, meta).view(-1, heads, d)
    for c, (_, _, ctx_k, ctx_v) in zip(prefills, contexts):
        assert torch.equal(out[c.start : c.end], kernel(q[c.start : c.end], ctx_k, ctx_v))


@pytest.mark.parametrize("threads,block_size", [(1, 4), (2, 4), (1, 128)])
def test_a_float32_engine_on_the_kernel_matches_transformers(tiny_models, monkeypatch, threads, block_size):
    """Llama's 16-wide heads run the kernel: greedy tokens equal transformers', whole prompts and chunks
    (after contexts of many blocks and of one)."""
    calls = []
    attend = kernels.PrefillAttentionKernel.attend
    monkeypatch.setattr(kernels.PrefillAttentionKernel, "attend", lambda *a: calls.append(1) or attend(*a))
    model = tiny_models["llama"]
    prompts = prompts_of([12, 12, 30, 5, 61, 9], seed=8)
    saved = torch.get_num_threads()
    try:
        run = run_engine(
            model.path,
            prompts,
            greedy(6),
            num_threads=threads,
            max_num_batched_tokens=32,
            block_size=block_size,
        )
    finally:
        torch.set_num_threads(saved)
    assert calls
    assert run.outputs == [model.greedy(p, 6) for p in prompts]
