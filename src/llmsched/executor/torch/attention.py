"""Paged attention over the block-table KV cache, for decodes and prefill chunks in one step.

A layer's cache is one [2, kv_heads, num_blocks, block_size, head_dim]
tensor (see kv_cache.py). The step's tokens arrive flattened with decodes
first (sorted by context length) and prefill chunks after. Each layer first
writes the step's new K/V into the cache at their slots, then:

- decodes run in groups of similar context length (on CPU sized so that a
  group's gathered K stays in cache; on CUDA one group). One index_select
  over the block dimension gathers the group's K (on CUDA K and V) for
  every KV head, already laid out as [kv_heads * requests, tokens,
  head_dim]. On CPU the scores are then one baddbmm (scale and mask folded
  in) and a softmax, and the probability-weighted sum of V is one
  embedding_bag that reads V's rows straight from the cache: a decode has
  only as many query rows per KV head as the GQA group (1-8), and for such
  shapes PyTorch's CPU SDPA kernel is 1.5-2x slower than plain batched
  matmuls, while a bmm over V first needs V copied out of the cache. Few,
  large kernels also matter when other processes share the cores, since
  each parallel region waits for its slowest thread. On CUDA the gather
  feeds SDPA.
- a prefill chunk starting at position 0 attends to its own fresh K/V with a
  causal SDPA (no gather); one starting later (after prefix-cache hits or
  earlier chunks) gathers its blocks the same way and uses an explicit
  offset-causal mask.

The query heads that share a KV head are laid out as that head's query rows,
so each gathered K/V row is read once per KV head, not once per query head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [start, end) of the step, their blocks and visibility mask."""

    start: int
    end: int
    block_table: torch.Tensor  # [G * nb] int64, row-major [G, nb]
    # Matmul path: additive [kv_heads * G, 1, nb * block_size] in the model
    # dtype (0 visible, -inf not), KV-head-major. SDPA path: bool [G, 1, 1, nb * block_size].
    mask: torch.Tensor
    # Matmul path, made by the first layer and reused by the others: the
    # cache row of every (KV head, request, query of the group, token) the
    # value sum reads, and where each of those bags starts.
    value_rows: torch.Tensor | None = None
    value_bags: torch.Tensor | None = None


@dataclass(slots=True)
class PrefillChunk:
    """Token rows [start, end) of one request's chunk starting at ``context_start``."""

    start: int
    end: int
    context_start: int
    # Only when context_start > 0: the blocks covering [0, context_start + n)
    # and the [n, nb * block_size] bool mask (key j visible to query i iff
    # j <= context_start + i).
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer's attention needs for one step; built once per step."""

    slot_mapping: torch.Tensor  # [tokens] int64: block * block_size + offset of each new token
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


class PagedAttention:
    """Writes new K/V into a layer's cache and computes attention for a step."""

    __slots__ = (
        "_buf",
        "_offsets",
        "_offsets_key",
        "block_size",
        "group",
        "head_dim",
        "matmul_decode",
        "num_heads",
        "num_kv_heads",
        "scale",
    )

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, matmul_decode: bool
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.block_size = block_size
        self.scale = head_dim**-0.5
        self.matmul_decode = matmul_decode
        # Gather buffer, grown on demand, reused by every layer and step.
        self._buf = torch.empty(0)
        # Row offset of each K/V head in the flattened cache, [2 * kv_heads, 1],
        # and the (blocks, device) it was made for.
        self._offsets = torch.empty(0, dtype=torch.int64)
        self._offsets_key: tuple[int, torch.device] | None = None

    def _gather(
        self, cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, planes: int = 2
    ) -> torch.Tensor:
        """K (and V unless ``planes`` is 1) of ``num_seqs`` equal-length block lists.

        Shaped [planes, kv_heads, num_seqs, tokens, head_dim].
        """
        nblocks = cache.shape[2]
        kv2 = planes * cache.shape[1]
        n = block_ids.numel()
        row = self.block_size * self.head_dim
        numel = kv2 * n * row
        buf = self._buf
        if buf.numel() < numel or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = self._buf = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        out = buf[:numel].view(kv2, n, row)
        if self._offsets_key != (nblocks, cache.device):
            heads = 2 * cache.shape[1]
            self._offsets = torch.arange(0, heads * nblocks, nblocks, device=cache.device)[:, None]
            self._offsets_key = (nblocks, cache.device)
        # The block list repeated for every K/V head, offset into the flattened
        # cache: one index_select along dim 0, the form PyTorch's CPU kernel
        # runs in parallel (along dim 1 it copies on one thread).
        rows = (block_ids + self._offsets[:kv2]).view(-1)
        torch.index_select(cache.view(-1, row)[: kv2 * nblocks], 0, rows, out=out.view(kv2 * n, row))
        return out.view(planes, self.num_kv_heads, num_seqs, (n // num_seqs) * self.block_size, self.head_dim)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention output [tokens, heads * head_dim] for q [tokens, heads, head_dim] and new k, v."""
        kvh, d, grp = self.num_kv_heads, self.head_dim, self.group
        slots = cache.view(2, kvh, -1, d)
        slots[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        slots[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty((q.shape[0], self.num_heads * d), dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            decode = self._decode_matmul if self.matmul_decode else self._decode_sdpa
            # [kv_heads, decodes, group, head_dim]: each KV head's queries together.
            qd = q[: meta.num_decodes].view(-1, kvh, grp, d).transpose(0, 1)
            for g in meta.decode_groups:
                decode(qd, cache, g, out)
        scale = self.scale
        for c in meta.prefills:
            qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)
            if c.block_ids is None:
                kc = k[c.start : c.end].transpose(0, 1).unsqueeze(0)
                vc = v[c.start : c.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qc, kc, vc, is_causal=True, scale=scale, enable_gqa=grp > 1
                )
            else:
                kv = self._gather(cache, c.block_ids, 1)
                o = F.scaled_dot_product_attention(
                    qc,
                    kv[0].transpose(0, 1),
                    kv[1].transpose(0, 1),
                    attn_mask=c.mask,
                    scale=scale,
                    enable_gqa=grp > 1,
                )
            out[c.start : c.end].view(-1, self.num_heads, d).copy_(o[0].transpose(0, 1))
        return out

    def _decode_matmul(
        self, qd: torch.Tensor, cache: torch.Tensor, g: DecodeGroup, out: torch.Tensor
    ) -> None:
        kvh, d, grp = self.num_kv_heads, self.head_dim, self.group
        n = g.end - g.start
        keys = self._gather(cache, g.block_table, n, planes=1)[0]
        t = keys.shape[2]
        queries = qd[:, g.start : g.end].reshape(kvh * n, grp, d)
        scores = torch.baddbmm(g.mask, queries, keys.view(kvh * n, t, d).transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, -1)
        if g.value_rows is None:
            self._value_bags(g, cache.shape[2], t)
        # The probability-weighted sum of V rows read straight from the cache:
        # no copy of V, and measured on a 2-core Zen4 about 1.5x faster than
        # gathering V and a bmm. Padded keys read the zero null block at weight 0.
        o = F.embedding_bag(
            g.value_rows, cache.view(-1, d), g.value_bags, mode="sum", per_sample_weights=probs.view(-1)
        )
        out[g.start : g.end].view(n, kvh, grp, d).copy_(o.view(kvh, n, grp, d).transpose(0, 1))

    def _value_bags(self, g: DecodeGroup, num_blocks: int, tokens: int) -> None:
        """Fill in the group's V rows (KV-head, request, query, token order) and bag starts."""
        kvh, bs, grp = self.num_kv_heads, self.block_size, self.group
        n = g.end - g.start
        dev = g.block_table.device
        # Token rows of each request's (padded) context within one head's plane.
        tok = (g.block_table.view(n, -1, 1) * bs + torch.arange(bs, device=dev)).view(1, n, 1, tokens)
        # V planes follow the kv_heads K planes in the flattened cache.
        planes = torch.arange(kvh, 2 * kvh, device=dev).view(kvh, 1, 1, 1) * (num_blocks * bs)
        g.value_rows = (tok + planes).expand(kvh, n, grp, tokens).reshape(-1)
        g.value_bags = torch.arange(0, g.value_rows.numel(), tokens, device=dev)

    def _decode_sdpa(self, qd: torch.Tensor, cache: torch.Tensor, g: DecodeGroup, out: torch.Tensor) -> None:
        kvh, d, grp = self.num_kv_heads, self.head_dim, self.group
        n = g.end - g.start
        kv = self._gather(cache, g.block_table, n)
        o = F.scaled_dot_product_attention(
            qd[:, g.start : g.end].transpose(0, 1),
            kv[0].transpose(0, 1),
            kv[1].transpose(0, 1),
            attn_mask=g.mask,
            scale=self.scale,
        )
        out[g.start : g.end].view(n, kvh, grp, d).copy_(o)
