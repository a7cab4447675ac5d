"""Shared cases for the C prefill attention kernels' tests (bfloat16 and float32).

Reference attention, inputs, and one paged layer step over fresh and cached chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmsched.executor.torch.attention import AttentionMetadata, PagedAttention, PrefillChunk
from llmsched.executor.torch.kernels import PrefillAttentionKernel


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


def attend(kernel: PrefillAttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The kernel's causal attention of q over k, v at the usual 1/sqrt(d) scale."""
    out = torch.empty(q.shape, dtype=q.dtype)
    kernel.attend(q, k, v, q.shape[-1] ** -0.5, out)
    return out


def fused_qkv(
    lq: int, lk: int, heads: int, kv_heads: int, d: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """q, k, v as slices of one fused projection (strided rows), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(lk, heads + 2 * kv_heads, d, generator=g) * 2).to(dtype)
    return qkv[lk - lq :, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]


def check_paged_chunks(
    kernel: PrefillAttentionKernel,
    chunks: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """One PagedAttention step over (cached, new) chunks: each chunk's rows are the kernel's attention.

    The cached part of a context is already in the cache; the step writes the new part.
    """
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s + n) // bs) for s, n in chunks)
    cache = torch.zeros(2, kv_heads, num_blocks, bs, d, dtype=dtype)
    keys = cache[0].view(kv_heads, num_blocks, d, bs)  # K blocks are stored transposed
    prefills, slots, new_k, new_v, contexts = [], [], [], [], []
    first = 0
    for start, n in chunks:
        ctx_k, ctx_v = (torch.randn(start + n, kv_heads, d, generator=g).to(dtype) for _ in range(2))
        blocks = torch.arange(first, first + -(-(start + n) // bs))
        first += len(blocks)
        for pos in range(start):
            keys[:, blocks[pos // bs], :, pos % bs] = ctx_k[pos]
            cache[1, :, blocks[pos // bs], pos % bs] = ctx_v[pos]
        rows = len(slots)
        slots += [int(blocks[p // bs]) * bs + p % bs for p in range(start, start + n)]
        prefills.append(PrefillChunk(rows, rows + n, start, block_ids=blocks if start else None))
        new_k.append(ctx_k[start:])
        new_v.append(ctx_v[start:])
        contexts.append((ctx_k, ctx_v))
    q = torch.randn(len(slots), heads, d, generator=g).to(dtype)
    slot_mapping = torch.tensor(slots)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        prefills=prefills,
        slot_blocks=slot_mapping // bs,
        slot_offsets=slot_mapping % bs,
    )
    attn = PagedAttention(heads, kv_heads, d, bs, keys_transposed=True)
    out = attn.forward(q, torch.cat(new_k), torch.cat(new_v), cache, meta).view(-1, heads, d)
    for c, (ctx_k, ctx_v) in zip(prefills, contexts):
        assert torch.equal(out[c.start : c.end], attend(kernel, q[c.start : c.end], ctx_k, ctx_v))
