"""Paged attention over the block-table KV cache, for decodes and prefill chunks in one step.

A layer's cache is one [2, kv_heads, num_blocks, block_size, head_dim]
tensor (see kv_cache.py): K then V, each KV head's blocks contiguous. On
CPU each K block is stored transposed, as [head_dim, block_size]. The
step's tokens arrive flattened with decodes first (sorted by context
length) and prefill chunks after. Each layer first writes the step's new
K/V into the cache at their slots, then:

- decodes run in groups of similar context length (on CPU cut where that
  saves more padding than a group's ops cost, see decode_groups.py; on
  CUDA one group). On CPU, both
  halves of attention are embedding_bag calls that read the cache in place,
  with no gathered copy of K or V. A decode has only as many query rows per
  KV head as the GQA group (1-8), and PyTorch's CPU batched matmul (and
  SDPA) runs such shapes far below the memory bandwidth; embedding_bag's
  weighted row sum runs near it:

  * scores: with K blocks stored [head_dim, block_size], a query's scores
    over one block are the sum of the block's head_dim rows weighted by the
    query's components, i.e. one bag per (request, KV head, query, block);
  * output: the probability-weighted sum of the context's V rows, one bag
    per (request, KV head, query), which is the output's row layout.

  Measured on a 2-core Zen4 at batch 64 with 500-token contexts, this is
  2-3x faster than gathering K and a batched matmul. For bfloat16 caches
  the C kernels (kernels/decode_attention.c) compute both halves with the
  same bits, reading only each request's context and no index or weight
  arrays: about 1.5x faster again. On CUDA the group's K
  and V are gathered (index_select over the block dimension) and fed to SDPA.
- a prefill chunk starting at position 0 attends to its own fresh K/V with a
  causal SDPA (no gather), adjacent ones of equal length in one batched
  call; one starting later (after prefix-cache hits or
  earlier chunks) gathers its blocks and uses an explicit offset-causal mask.
  On CPUs with AVX-512 BF16, bfloat16 chunks of 64-wide heads (64, 128, ...)
  run the C kernel (kernels/prefill_attention.c) instead: 3-4x faster than
  PyTorch's flash kernel, with bits of its own that do not depend on where a
  chunk starts, so chunked prefill and prefix-cache hits give a query the
  bits a whole-prompt prefill would. Float32 chunks of heads in 16s run its
  AVX2 twin (kernels/prefill_attention_f32.c) the same way: ~1.4x faster
  than the flash kernel on one thread (a 2,048-token SmolLM2 layer, 71 ms
  against 102 ms of CPU time on a Zen 4 core).

The query heads that share a KV head are laid out as that head's query rows,
so each cached row is fetched from memory once per KV head, not once per
query head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmsched.executor.torch.kernels import (
    DecodeAttentionKernels,
    PrefillAttentionKernel,
    decode_attention,
    prefill_attention,
    prefill_attention_f32,
)

# Decode output bags skip the unused rows of requests' last blocks only
# when the group's visible share of its rows is below this: selecting the
# visible probabilities costs ~0.6 ns per kept row, a skipped V row saves
# ~2.5 ns (one thread, SmolLM2's shapes).
SKIP_UNUSED_ROWS_BELOW = 0.8


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [start, end) of the step, their blocks and visibility mask."""

    start: int
    end: int
    block_table: torch.Tensor  # [G * nb] int64, row-major [G, nb]
    # CPU path: additive [1, G, 1, nb * block_size] in the model dtype (0
    # visible, -inf not). CUDA path: bool [G, 1, 1, nb * block_size].
    mask: torch.Tensor
    # CPU path, made by the first layer and reused by the others: the cache
    # rows each score bag and each output bag reads (see PagedAttention),
    # flattened, with each bag's first index (equal-sized bags).
    key_rows: torch.Tensor | None = None
    value_rows: torch.Tensor | None = None
    key_offsets: torch.Tensor | None = None
    value_offsets: torch.Tensor | None = None
    # The visible entries of the flattened probabilities, in output-bag
    # order (None when every request fills the group's blocks).
    visible_probs: torch.Tensor | None = None
    # CPU path: each request's context length [G] int64, for the C kernels.
    lens: torch.Tensor | None = None


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
    # With transposed K blocks: slot_mapping split into block and offset.
    slot_blocks: torch.Tensor | None = None
    slot_offsets: torch.Tensor | None = None


def fresh_runs(prefills: list[PrefillChunk]) -> list[tuple[int, int, int]]:
    """(first row, end row, chunks) of each run of adjacent equal-length chunks starting at position 0."""
    runs: list[tuple[int, int, int]] = []
    for c in prefills:
        if c.block_ids is not None:
            continue
        if runs:
            start, end, n = runs[-1]
            if end == c.start and c.end - c.start == (end - start) // n:
                runs[-1] = (start, c.end, n + 1)
                continue
        runs.append((c.start, c.end, 1))
    return runs


class PagedAttention:
    """Writes new K/V into a layer's cache and computes attention for a step."""

    __slots__ = (
        "_buf",
        "_offsets",
        "_offsets_key",
        "_weights",
        "block_size",
        "group",
        "head_dim",
        "kernels",
        "keys_transposed",
        "num_heads",
        "num_kv_heads",
        "prefill_kernel",
        "prefill_kernel_f32",
        "scale",
    )

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, keys_transposed: bool
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.block_size = block_size
        self.scale = head_dim**-0.5
        # K blocks stored [head_dim, block_size] and the embedding_bag decode (CPU).
        self.keys_transposed = keys_transposed
        # The C decode kernels (same bits as the bags, fewer bytes read), or None.
        self.kernels = decode_attention() if keys_transposed else None
        # The C prefill kernels (CPU, bfloat16 and float32), or None.
        self.prefill_kernel: PrefillAttentionKernel | None = None
        self.prefill_kernel_f32: PrefillAttentionKernel | None = None
        pk = prefill_attention() if keys_transposed else None
        if pk is not None and pk.supports(torch.bfloat16, head_dim):
            self.prefill_kernel = pk
        pk = prefill_attention_f32() if keys_transposed else None
        if pk is not None and pk.supports(torch.float32, head_dim):
            self.prefill_kernel_f32 = pk
        # Gather buffer, grown on demand, reused by every layer and step.
        self._buf = torch.empty(0)
        # Row offset of each K/V head in the flattened cache, [2 * kv_heads, 1],
        # and the (blocks, device) it was made for.
        self._offsets = torch.empty(0, dtype=torch.int64)
        self._offsets_key: tuple[int, torch.device] | None = None
        # The decode score bags' weights (with the C kernels: the scores), grown on
        # demand, reused by every layer and step.
        self._weights = torch.empty(0)

    def _gather(
        self, cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``num_seqs`` equal-length block lists, each [kv_heads, num_seqs, tokens, head_dim]."""
        kvh, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        nblocks = cache.shape[2]
        n = block_ids.numel()
        row = bs * d
        numel = 2 * kvh * n * row
        buf = self._buf
        if buf.numel() < numel or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = self._buf = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        out = buf[:numel].view(2 * kvh, n, row)
        if self._offsets_key != (nblocks, cache.device):
            self._offsets = torch.arange(0, 2 * kvh * nblocks, nblocks, device=cache.device)[:, None]
            self._offsets_key = (nblocks, cache.device)
        # The block list repeated for every K/V head, offset into the flattened
        # cache: one index_select along dim 0, the form PyTorch's CPU kernel
        # runs in parallel (along dim 1 it copies on one thread).
        rows = (block_ids + self._offsets).view(-1)
        torch.index_select(cache.view(-1, row), 0, rows, out=out.view(2 * kvh * n, row))
        tokens = (n // num_seqs) * bs
        kv = out.view(2, kvh, num_seqs, tokens, d)
        if not self.keys_transposed:
            return kv[0], kv[1]
        keys = out[:kvh].view(kvh, num_seqs, n // num_seqs, d, bs).transpose(-1, -2)
        return keys.reshape(kvh, num_seqs, tokens, d), kv[1]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention output [tokens, heads * head_dim] for q [tokens, heads, head_dim] and new k, v."""
        kvh, d, grp = self.num_kv_heads, self.head_dim, self.group
        kern = self.kernels
        if kern is not None and kern.writes(cache, k, v):
            kern.write_kv(k, v, cache, meta.slot_blocks, meta.slot_offsets)
        else:
            if self.keys_transposed:
                cache[0].view(kvh, -1, d, self.block_size)[:, meta.slot_blocks, :, meta.slot_offsets] = k
            else:
                cache[0].view(kvh, -1, d).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
            cache[1].view(kvh, -1, d).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        groups = meta.decode_groups
        if self.keys_transposed and len(groups) == 1 and groups[0].end - groups[0].start == q.shape[0]:
            # A decode-only step in one group: the output bags are the output.
            return self._decode_cpu(q, cache, groups[0], None)
        pk = self._prefill_kernel_for(q.dtype)
        # On one thread only: with more, the kernel splits a batch's work over
        # threads differently from one chunk's, which moves float32 results
        # by an ulp (its matmuls round by buffer alignment).
        runs = fresh_runs(meta.prefills) if pk is None and torch.get_num_threads() == 1 else []
        if not meta.num_decodes and len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == q.shape[0]:
            # A step of equal-length fresh prompts only: the kernel's output
            # already has the token-major layout, so it is returned as is.
            return self._prefill_fresh(q, k, v, 0, q.shape[0], runs[0][2], None)
        out = torch.empty((q.shape[0], self.num_heads * d), dtype=q.dtype, device=q.device)
        if meta.num_decodes and self.keys_transposed:
            for g in groups:
                self._decode_cpu(q, cache, g, out[g.start : g.end])
        elif meta.num_decodes:
            # [kv_heads, decodes, group, head_dim]: each KV head's queries together.
            qd = q[: meta.num_decodes].reshape(-1, kvh, grp, d).transpose(0, 1)
            for g in groups:
                self._decode_sdpa(qd, cache, g, out)
        for start, end, n in runs:
            self._prefill_fresh(q, k, v, start, end, n, out)
        for c in meta.prefills:
            if c.block_ids is not None:
                self._prefill_cached(q, cache, c, pk, out)
            elif pk is not None:
                pk.attend(
                    q[c.start : c.end],
                    k[c.start : c.end],
                    v[c.start : c.end],
                    self.scale,
                    out[c.start : c.end].view(-1, self.num_heads, d),
                )
            elif not runs:
                self._prefill_fresh(q, k, v, c.start, c.end, 1, out)
        return out

    def _prefill_kernel_for(self, dtype: torch.dtype) -> PrefillAttentionKernel | None:
        """The C prefill kernel for chunks of this dtype, or None (PyTorch's SDPA runs)."""
        if dtype == torch.bfloat16:
            return self.prefill_kernel
        return self.prefill_kernel_f32 if dtype == torch.float32 else None

    def _prefill_cached(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        c: PrefillChunk,
        pk: PrefillAttentionKernel | None,
        out: torch.Tensor,
    ) -> None:
        """Attention of a chunk after cached context, over its gathered blocks, into its rows of ``out``."""
        kc, vc = self._gather(cache, c.block_ids, 1)
        rows = out[c.start : c.end].view(-1, self.num_heads, self.head_dim)
        if pk is not None:
            seen = c.context_start + c.end - c.start
            keys = kc[:, 0, :seen].transpose(0, 1)
            if keys.stride(-1) != 1:
                # A one-block context: _gather's reshape kept the transposed
                # K block as a view, and the kernel reads each row's head_dim
                # values contiguously.
                keys = keys.contiguous()
            pk.attend(q[c.start : c.end], keys, vc[:, 0, :seen].transpose(0, 1), self.scale, rows)
            return
        o = F.scaled_dot_product_attention(
            q[c.start : c.end].transpose(0, 1).unsqueeze(0),
            kc.transpose(0, 1),
            vc.transpose(0, 1),
            attn_mask=c.mask,
            scale=self.scale,
            enable_gqa=self.group > 1,
        )
        rows.copy_(o[0].transpose(0, 1))

    def _prefill_fresh(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        end: int,
        n: int,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal attention of ``n`` equal-length fresh chunks filling rows [start, end), as one batch.

        The flash kernel computes each (chunk, head, query block) on its own
        with sizes set by the chunk length alone, so on one thread one call
        over the batch gives every chunk the bits a call of its own would,
        with one call (and one output copy) per layer instead of one per chunk.
        """
        nh, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        length = (end - start) // n
        o = F.scaled_dot_product_attention(
            q[start:end].view(n, length, nh, d).transpose(1, 2),
            k[start:end].view(n, length, kvh, d).transpose(1, 2),
            v[start:end].view(n, length, kvh, d).transpose(1, 2),
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.group > 1,
        ).transpose(1, 2)
        if out is None:
            return o.reshape(end - start, nh * d)
        out[start:end].view(n, length, nh, d).copy_(o)
        return out

    def _decode_cpu(
        self, q: torch.Tensor, cache: torch.Tensor, g: DecodeGroup, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The group's attention output [requests, heads * head_dim], written into ``out`` if given."""
        kern = self.kernels
        if kern is not None and g.lens is not None and kern.supports(cache.dtype, self.group, self.head_dim):
            return self._decode_kernels(kern, q, cache, g, out)
        o = self._decode_bags(q, cache, g)
        return o if out is None else out.copy_(o)

    def _decode_kernels(
        self,
        kern: DecodeAttentionKernels,
        q: torch.Tensor,
        cache: torch.Tensor,
        g: DecodeGroup,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The group's attention output from the C kernels: the bags' bits, reading only each context."""
        kvh, d, grp, bs = self.num_kv_heads, self.head_dim, self.group, self.block_size
        n = g.end - g.start
        nb = g.block_table.numel() // n
        qg = q[g.start : g.end]
        if qg.stride(2) != 1 or qg.stride(1) != d:
            qg = qg.contiguous()
        table = g.block_table.view(n, nb)
        numel = n * kvh * grp * nb * bs
        buf = self._weights
        if buf.numel() < numel or buf.dtype != q.dtype:
            buf = self._weights = torch.empty(numel, dtype=q.dtype)
        scores = buf[:numel].view(n, kvh, grp, nb * bs)
        kern.scores(qg, self.scale, cache[0].view(kvh, -1, d, bs), table, g.lens, grp, scores)
        probs = torch.softmax(scores, -1)
        if out is None:
            out = torch.empty((n, kvh * grp * d), dtype=q.dtype)
        kern.output(probs, cache[1], table, g.lens, out)
        return out

    def _decode_bags(self, q: torch.Tensor, cache: torch.Tensor, g: DecodeGroup) -> torch.Tensor:
        """The group's attention output [requests, heads * head_dim], from two embedding_bag calls.

        Bags run request-major, (request, KV head, query[, block]), so the
        output bags come out in the output's own row layout, with no
        transposing copy; each bag sums the same rows in the same order as
        in any other bag order, so the bits do not depend on it.
        """
        kvh, d, grp, bs = self.num_kv_heads, self.head_dim, self.group, self.block_size
        n = g.end - g.start
        nb = g.block_table.numel() // n
        if g.key_rows is None:
            self._bag_rows(g, cache.shape[2], n, nb)
        # One weight per (request, KV head, query, block, K row): the query
        # repeated over the request's blocks and scaled, in one op (the
        # same product, element by element, as scaling first).
        numel = n * kvh * grp * nb * d
        w = self._weights
        if w.numel() < numel or w.dtype != q.dtype or w.device != q.device:
            w = self._weights = torch.empty(numel, dtype=q.dtype, device=q.device)
        w = w[:numel]
        qg = q[g.start : g.end].reshape(n, kvh, grp, 1, d).expand(n, kvh, grp, nb, d)
        torch.mul(qg, self.scale, out=w.view(n, kvh, grp, nb, d))
        # 1-D rows with precomputed offsets: the same bags as 2-D rows, without
        # embedding_bag building the offsets (and reshaping) on every call.
        scores = F.embedding_bag(
            g.key_rows, cache.view(-1, bs), g.key_offsets, mode="sum", per_sample_weights=w
        ).view(n, kvh, grp, nb * bs)
        probs = torch.softmax(scores.add_(g.mask.view(n, 1, 1, nb * bs)), -1).view(-1)
        if g.visible_probs is not None:
            probs = probs.index_select(0, g.visible_probs)
        o = F.embedding_bag(
            g.value_rows, cache.view(-1, d), g.value_offsets, mode="sum", per_sample_weights=probs
        )
        return o.view(n, kvh * grp * d)

    def _bag_rows(self, g: DecodeGroup, num_blocks: int, n: int, nb: int) -> None:
        """Fill in the group's flat score-bag rows (head_dim a bag) and output-bag rows (its context)."""
        kvh, d, bs, grp = self.num_kv_heads, self.head_dim, self.block_size, self.group
        dev = g.block_table.device
        table = g.block_table.view(n, 1, 1, nb)
        heads = torch.arange(kvh, device=dev).view(1, kvh, 1, 1) * num_blocks
        # K plane, viewed as rows of block_size: block b of head h holds rows
        # (h * num_blocks + b) * head_dim + [0, head_dim).
        kblock = (table + heads) * d  # [n, kvh, 1, nb]
        g.key_rows = (
            (kblock.unsqueeze(-1) + torch.arange(d, device=dev)).expand(n, kvh, grp, nb, d).reshape(-1)
        )
        g.key_offsets = torch.arange(0, g.key_rows.numel(), d, device=dev)
        # V plane (after the kv_heads K planes), viewed as rows of head_dim.
        vtok = ((table + heads + kvh * num_blocks) * bs).unsqueeze(-1) + torch.arange(bs, device=dev)
        vtok = vtok.view(n, kvh, 1, nb * bs).expand(n, kvh, grp, nb * bs)
        # Output bags read only each request's context, not the rest of its
        # last block nor padding blocks: those rows had weight 0, and the bag
        # sums its rows in order, so dropping trailing zero-weight rows keeps
        # every sum as it was, with fewer V bytes read.
        visible = g.mask.view(n, 1, 1, nb * bs) == 0
        # Each request's context length, for each of its (KV head, query) bags.
        lens = visible.sum(-1).expand(n, kvh, grp).reshape(-1)
        rows = vtok.reshape(-1)
        if int(lens.sum()) >= SKIP_UNUSED_ROWS_BELOW * lens.numel() * nb * bs:
            # Mostly full blocks: selecting the visible probabilities would
            # cost more than the few V rows it saves.
            lens.fill_(nb * bs)
            g.value_rows = rows
            g.visible_probs = None
        else:
            # One nonzero serves both: the kept probabilities and their V rows.
            keep = visible.expand(n, kvh, grp, nb * bs).reshape(-1).nonzero().view(-1)
            g.value_rows = rows.index_select(0, keep)
            g.visible_probs = keep
        g.value_offsets = lens.cumsum(0) - lens

    def _decode_sdpa(self, qd: torch.Tensor, cache: torch.Tensor, g: DecodeGroup, out: torch.Tensor) -> None:
        kvh, d, grp = self.num_kv_heads, self.head_dim, self.group
        n = g.end - g.start
        kc, vc = self._gather(cache, g.block_table, n)
        o = F.scaled_dot_product_attention(
            qd[:, g.start : g.end].transpose(0, 1),
            kc.transpose(0, 1),
            vc.transpose(0, 1),
            attn_mask=g.mask,
            scale=self.scale,
        )
        out[g.start : g.end].view(n, kvh, grp, d).copy_(o)
