"""Per-request state kept across steps, and turning a scheduled step into model inputs.

The executor keeps, for every request the scheduler has running, its block
table (a row of one persistent tensor, so a step's decode tables are one
index_select) and its penalty counters. Each step updates that state:
finished and preempted requests are dropped (a preempted one returns later
as an admission with a fresh table), admissions bring their whole table,
running requests their appended blocks.

A step reaches the executor's thread as a StepPlan: the SchedulerOutput's
own lists (never changed after schedule()) plus every value read from its
Requests, copied by ``plan_step`` when the step is scheduled, since the
engine changes the Requests while the step waits or runs (async
scheduling). Only immutable Request fields (sampling parameters, prompt,
stop ids) are read later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from llmsched.core.output import SchedulerOutput
from llmsched.core.request import Request
from llmsched.executor.torch.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from llmsched.executor.torch.decode_groups import group_by_padding, split_by_byte_budget
from llmsched.executor.torch.kv_cache import cdiv
from llmsched.executor.torch.lora.step import Span, row_spans


@dataclass(slots=True)
class RequestState:
    """What the executor remembers about one running request.

    ``generated`` is the executor's own copy of the output tokens: those the
    request held when admitted, then every token sampled here. With async
    scheduling it runs a step ahead of ``request.token_ids``, which only
    grows when the engine applies a step's output; the sampler and the next
    step's inputs read it instead, so the engine may change the Request
    while a step runs.
    """

    request: Request
    row: int
    num_blocks: int
    generated: list[int]
    # Sampler state, created on first use: output-token counts over the
    # vocabulary, how many output tokens they cover, and the prompt's token set.
    output_counts: torch.Tensor | None = None
    counted: int = 0
    prompt_mask: torch.Tensor | None = None
    # The output grammar's matcher (constrained requests only): advanced with
    # each token sampled here, so it is as far ahead as ``generated``.
    matcher: Any = None
    # Speculative decoding: set once this admission sampled (its next input
    # is its last sampled token), and the drafts proposed after that sample.
    decoding: bool = False
    drafts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    """A scheduled step, with the Request values it needs copied at schedule time.

    Per scheduled request, in schedule order: the first position, the token
    count (both grown back to ``recompute_from`` where it applies), the
    input tokens (None for a decode whose input is sampled by a step still
    in flight) and whether it samples. Per admission: its output tokens.
    """

    so: SchedulerOutput
    starts: list[int]
    counts: list[int]
    tokens: list[list[int] | None]
    samples: list[bool]
    admitted_outputs: list[list[int]]
    # Speculative decoding: per scheduled request, how many of its last
    # input tokens are drafts to verify (None: none in this step).
    verify: list[int] | None = None
    # Requests asking for prompt logprobs whose chunk covers prompt positions
    # before the last: (scheduled index, first position, count, the prompt
    # tokens those positions predict, top-N).
    prompt_lp: list[tuple[int, int, int, list[int], int]] = field(default_factory=list)


def plan_step(so: SchedulerOutput, verifies_drafts: bool = False) -> StepPlan:
    """Copy what the step needs from its Requests; call right after schedule(), on the engine's thread.

    Draft tokens are refused unless the caller verifies them (``verifies_drafts``).
    """
    if so.spec_decode_tokens and not verifies_drafts:
        raise NotImplementedError(
            "the step schedules speculative draft tokens, but the torch executor was started "
            "without a speculative_config"
        )
    starts: list[int] = []
    counts: list[int] = []
    tokens: list[list[int] | None] = []
    samples: list[bool] = []
    prompt_lp: list[tuple[int, int, int, list[int], int]] = []
    recompute = so.recompute_from
    for req, n in zip(so.scheduled, so.num_scheduled_tokens):
        start = req.num_computed_tokens - n
        if recompute:
            p = recompute.get(req.request_id)
            if p is not None and so.mamba_state_ids is not None:
                # A hybrid model's Mamba state at p is in no block: recompute from 0.
                p = 0
            if p is not None and p < start:
                # Its prefix-cache hit covers blocks a withdrawn chunk
                # registered but never wrote: the KV there is garbage, so
                # the chunk grows back to p and rewrites those slots (as a
                # prefill, even for one scheduled token). Every layer
                # writes the step's K/V before attending, so others hitting
                # the same blocks in this step read the rewritten KV.
                n += start - p
                start = p
        starts.append(start)
        counts.append(n)
        # Positions past the known tokens are being sampled by a step in flight (a decode's only input).
        tokens.append(req.token_ids[start : start + n] if start < req.num_tokens else None)
        samples.append(not req.is_prefill_chunk)
        k = req.sampling_params.prompt_logprobs
        if k is not None:
            # The last prompt position's logits are the first sample's, as usual.
            end = min(start + n, req.num_prompt_tokens - 1)
            if start < end:
                targets = req.prompt_token_ids[start + 1 : end + 1]
                prompt_lp.append((len(starts) - 1, start, end - start, targets, k))
    outputs = [r.token_ids[r.num_prompt_tokens :] for r in so.admitted]
    return StepPlan(so, starts, counts, tokens, samples, outputs, prompt_lp=prompt_lp)


@dataclass(slots=True)
class StepInputs:
    """A step's model inputs and which scheduled requests sample.

    A decode whose input token was still being sampled by the step before
    (async scheduling) is a hole in ``token_ids``, filled by ``input_ids()``
    from the executor's own samples once that step has run.
    """

    num_scheduled: int
    token_ids: list[int]
    # (row, state, position): inputs the executor sampled itself, not known yet.
    holes: list[tuple[int, RequestState, int]]
    positions: torch.Tensor
    attn: AttentionMetadata
    # Rows whose hidden state goes to the LM head, ascending.
    logits_indices: torch.Tensor
    # For each logits row, the index into scheduler_output.scheduled.
    sample_sched_index: list[int] = field(default_factory=list)
    sample_states: list[RequestState] = field(default_factory=list)
    # Speculative decoding: per sampling request, its drafts to verify, and
    # its 1 + len(drafts) rows of the logits (None: one row each, in order).
    sample_drafts: list[list[int]] | None = None
    sample_logit_rows: list[list[int]] | None = None
    # Rows that run a LoRA adapter (empty: the base model alone).
    lora_spans: list[Span] = field(default_factory=list)
    # Multimodal steps only: each scheduled request's first input row, and
    # the step's encoder work (an encoder_outputs.MMStep).
    sched_rows: list[int] | None = None
    mm: Any = None
    # Hybrid models only: the step's Mamba state reads and writes (a hybrid.state.MambaStep).
    mamba: Any = None
    # Prompt logprobs only: which logits rows the sampler gets (None: all,
    # the plain case), and per asking request (scheduled index, request id,
    # first position of its entries, its logits rows, target tokens, top-N).
    sample_pick: torch.Tensor | None = None
    prompt_lp: list[tuple[int, str, int, torch.Tensor, list[int], int]] | None = None

    def input_ids(self, device: torch.device) -> torch.Tensor:
        """The input tokens, holes filled from the executor's own samples (call once the step before ran)."""
        ids = self.token_ids
        for row, st, pos in self.holes:
            ids[row] = st.generated[pos - st.request.num_prompt_tokens]
        return torch.tensor(ids, dtype=torch.int64).to(device)


class InputBatch:
    """Request states plus the builder of each step's flattened inputs."""

    def __init__(
        self,
        *,
        block_size: int,
        max_blocks_per_request: int,
        max_num_seqs: int,
        device: torch.device,
        decode_group_bytes: int,
        kv_row_bytes: int,
        keys_transposed: bool,
        dtype: torch.dtype,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks_per_request
        self.device = device
        self.states: dict[str, RequestState] = {}
        self.block_table = torch.zeros((max_num_seqs, max_blocks_per_request), dtype=torch.int64)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        # A cap on a decode group's padded K (one of K, V) bytes in one layer.
        self.decode_group_bytes = decode_group_bytes
        # Bytes of one token's K in one layer.
        self.kv_row_bytes = kv_row_bytes
        self._arange = torch.arange(max_blocks_per_request * block_size, dtype=torch.int64)
        # On CUDA one group serves every decode: there is no cache to fit.
        self._single_group = device.type != "cpu"
        # The CPU decode path (transposed K blocks) adds a mask in the model
        # dtype and writes K by (block, offset); SDPA takes a bool mask.
        self.keys_transposed = keys_transposed
        self.dtype = dtype
        # Set when the executor serves LoRA adapters: each step records its adapters' rows.
        self.lora_enabled = False

    # ---- state ------------------------------------------------------------------

    def update(self, plan: StepPlan) -> None:
        """Apply a step's finishes, preemptions, admissions and appended blocks."""
        so = plan.so
        states = self.states
        for rid in so.finished_req_ids:
            self._drop(rid)
        for req in so.preempted:
            self._drop(req.request_id)
        for req, block_ids, outputs in zip(so.admitted, so.admitted_block_ids, plan.admitted_outputs):
            # An id reused after finishing, or resumed after preemption.
            self._drop(req.request_id)
            row = self._take_row()
            n = len(block_ids)
            if n > self.max_blocks:
                raise ValueError(
                    f"request {req.request_id!r} has {n} KV blocks, more than max_model_len allows "
                    f"({self.max_blocks}); the scheduler and executor disagree on max_model_len"
                )
            if n:
                self.block_table[row, :n] = torch.tensor(block_ids, dtype=torch.int64)
            st = states[req.request_id] = RequestState(req, row, n, outputs)
            if req.grammar is not None:
                from llmsched.structured.matcher import new_matcher

                st.matcher = new_matcher(req.grammar, outputs)
        for rid, block_ids in so.new_block_ids.items():
            st = states.get(rid)
            if st is None:
                raise KeyError(f"blocks appended to request {rid!r}, which the executor never saw admitted")
            n, k = st.num_blocks, len(block_ids)
            if n + k > self.max_blocks:
                raise ValueError(
                    f"request {rid!r} grew to {n + k} KV blocks, more than max_model_len allows "
                    f"({self.max_blocks}); the scheduler and executor disagree on max_model_len"
                )
            self.block_table[st.row, n : n + k] = torch.tensor(block_ids, dtype=torch.int64)
            st.num_blocks = n + k

    def _take_row(self) -> int:
        if not self._free_rows:
            # More running requests than max_num_seqs promised: grow rather than fail.
            old = self.block_table
            self.block_table = torch.zeros((2 * old.shape[0], old.shape[1]), dtype=torch.int64)
            self.block_table[: old.shape[0]] = old
            self._free_rows = list(range(2 * old.shape[0] - 1, old.shape[0] - 1, -1))
        return self._free_rows.pop()

    def _drop(self, rid: str) -> None:
        st = self.states.pop(rid, None)
        if st is not None:
            # Zeros point padded table entries at the null block.
            self.block_table[st.row, : st.num_blocks] = 0
            self._free_rows.append(st.row)

    def clear(self) -> None:
        """Forget every request."""
        for rid in list(self.states):
            self._drop(rid)

    # ---- one step's inputs ----------------------------------------------------------

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Flatten the scheduled chunks: decodes first (shortest context first), then prefills."""
        so = plan.so
        states = self.states
        bs = self.block_size
        decodes: list[tuple[int, int, RequestState]] = []  # (position, scheduled index, state)
        prefills: list[tuple[int, int, int, RequestState]] = []  # (start, n, scheduled index, state)
        verify = plan.verify
        for i, (req, start, n) in enumerate(zip(so.scheduled, plan.starts, plan.counts)):
            st = states.get(req.request_id)
            if st is None:
                raise KeyError(f"request {req.request_id!r} is scheduled but was never admitted")
            if start + n > st.num_blocks * bs:
                raise ValueError(
                    f"request {req.request_id!r} runs up to position {start + n} but holds "
                    f"only {st.num_blocks} blocks of {bs}"
                )
            if n == 1:
                decodes.append((start, i, st))
            elif verify is not None and verify[i] == n - 1:
                # The last token and its drafts: one decode query per position
                # (each layer writes the step's K/V before attending, so a
                # draft sees those before it), batched with the other decodes.
                decodes.extend((start + j, i, st) for j in range(n))
            else:
                prefills.append((start, n, i, st))
        decodes.sort(key=_position)

        ids: list[int] = []
        holes: list[tuple[int, RequestState, int]] = []
        sample_rows: list[tuple[int, int, RequestState]] = []  # (row, scheduled index, state)
        tokens, samples = plan.tokens, plan.samples
        nd = len(decodes)
        need_rows = so.encoder_inputs is not None or so.mamba_state_ids is not None
        sched_rows = [0] * len(so.scheduled) if need_rows else None
        for row, (pos, i, st) in enumerate(decodes):
            if sched_rows is not None:
                sched_rows[i] = row
            known = tokens[i]
            if known is not None:
                ids.append(known[pos - plan.starts[i]])
            else:
                # Sampled by the step before, still in flight when this one was planned.
                ids.append(0)
                holes.append((row, st, pos))
            if samples[i]:
                sample_rows.append((row, i, st))
        table = self.block_table
        if nd:
            dpos = torch.tensor([p for p, _, _ in decodes], dtype=torch.int64)
            drows = torch.tensor([st.row for _, _, st in decodes], dtype=torch.int64)
            dslots = table[drows, dpos // bs] * bs + dpos % bs
            groups = self._decode_groups(decodes, drows, dpos)
        else:
            groups = []
        pos_parts = [dpos] if nd else []
        slot_parts = [dslots] if nd else []
        chunks: list[PrefillChunk] = []
        row = nd
        for start, n, i, st in prefills:
            if sched_rows is not None:
                sched_rows[i] = row
            ids.extend(tokens[i])  # type: ignore[arg-type]
            pos = self._arange[start : start + n]
            pos_parts.append(pos)
            table_row = table[st.row]
            slot_parts.append(table_row[pos // bs] * bs + pos % bs)
            chunk = PrefillChunk(row, row + n, start)
            if start > 0:
                nb = cdiv(start + n, bs)
                # A copy: the table row may be dropped and reused for the
                # next step while this one runs (async scheduling).
                chunk.block_ids = table_row[:nb].to(self.device, copy=True)
                qpos = pos[:, None]
                chunk.mask = (self._arange[None, : nb * bs] <= qpos).to(self.device)
            chunks.append(chunk)
            row += n
            if samples[i]:
                v = verify[i] if verify is not None else 0
                sample_rows.extend((row - 1 - v + j, i, st) for j in range(v + 1))
        if prefills:
            # Rows must ascend; decodes and prefills each already do.
            sample_rows.sort(key=_first)
        dev = self.device
        positions = pos_parts[0] if len(pos_parts) == 1 else torch.cat(pos_parts)
        slots = slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts)
        attn = AttentionMetadata(
            slot_mapping=slots.to(dev), num_decodes=nd, decode_groups=groups, prefills=chunks
        )
        if self.keys_transposed:
            attn.slot_blocks = (slots // bs).to(dev)
            attn.slot_offsets = (slots % bs).to(dev)
        lora_spans: list[Span] = []
        if self.lora_enabled:
            lora_spans = row_spans(
                [st.request.lora_id for _, _, st in decodes],
                [(n, st.request.lora_id) for _, n, _, st in prefills],
            )
        step = StepInputs(
            num_scheduled=len(so.scheduled),
            token_ids=ids,
            holes=holes,
            positions=positions.to(dev),
            attn=attn,
            logits_indices=torch.tensor([r for r, _, _ in sample_rows], dtype=torch.int64).to(dev),
            **_samplers(sample_rows, plan),
            lora_spans=lora_spans,
            sched_rows=sched_rows,
        )
        if plan.prompt_lp:
            first_rows = {i: r for r, (_, i, _) in enumerate(decodes)}
            r = nd
            for _, n, i, _ in prefills:
                first_rows[i] = r
                r += n
            _add_prompt_rows(step, plan, [row for row, _, _ in sample_rows], first_rows, dev)
        return step

    def decode_metadata(self, entries: list[tuple[int, RequestState]]) -> AttentionMetadata:
        """Attention inputs for one token per request at the given positions (ascending), as decodes."""
        bs = self.block_size
        decodes = [(p, i, st) for i, (p, st) in enumerate(entries)]
        dpos = torch.tensor([p for p, _ in entries], dtype=torch.int64)
        drows = torch.tensor([st.row for _, st in entries], dtype=torch.int64)
        slots = self.block_table[drows, dpos // bs] * bs + dpos % bs
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=slots.to(dev),
            num_decodes=len(entries),
            decode_groups=self._decode_groups(decodes, drows, dpos),
            prefills=[],
        )
        if self.keys_transposed:
            attn.slot_blocks = (slots // bs).to(dev)
            attn.slot_offsets = (slots % bs).to(dev)
        return attn

    def _decode_groups(
        self, decodes: list[tuple[int, int, RequestState]], rows: torch.Tensor, positions: torch.Tensor
    ) -> list[DecodeGroup]:
        """Cut the length-sorted decodes into groups: few, little padding, each within the byte budget."""
        bs = self.block_size
        n = len(decodes)
        if self._single_group:
            bounds = [0, n]
        else:
            widths = [cdiv(d[0] + 1, bs) for d in decodes]
            bounds = split_by_byte_budget(
                group_by_padding(widths, bs), widths, bs * self.kv_row_bytes, self.decode_group_bytes
            )
        groups = []
        dev = self.device
        for s, e in pairwise(bounds):
            nb = cdiv(decodes[e - 1][0] + 1, bs)
            table = self.block_table[:, :nb].index_select(0, rows[s:e])
            lens = positions[s:e] + 1
            visible = self._arange[None, : nb * bs] < lens[:, None]
            if self.keys_transposed:
                mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
                # Broadcast over KV heads and queries: scores are [kv_heads, G, group, tokens].
                mask = mask.view(1, e - s, 1, nb * bs)
            else:
                mask = visible.view(e - s, 1, 1, nb * bs)
            group = DecodeGroup(s, e, table.view(-1).to(dev), mask.to(dev))
            if self.keys_transposed:
                group.lens = lens.to(dev, torch.int64)
            groups.append(group)
        return groups


def _add_prompt_rows(
    step: StepInputs, plan: StepPlan, sample_rows: list[int], first_rows: dict[int, int], dev: torch.device
) -> None:
    """Widen the LM head's rows to the prompt positions that want logprobs (ascending, no repeats)."""
    wanted: list[tuple[int, list[int]]] = []
    rows = set(sample_rows)
    for i, start, n, _, _ in plan.prompt_lp:
        # Recomputed chunks (recompute_from) start at plan.starts[i], before ``start`` perhaps.
        r0 = first_rows[i] + start - plan.starts[i]
        own = list(range(r0, r0 + n))
        wanted.append((i, own))
        rows.update(own)
    union = sorted(rows)
    at = {r: k for k, r in enumerate(union)}
    step.logits_indices = torch.tensor(union, dtype=torch.int64).to(dev)
    step.sample_pick = torch.tensor([at[r] for r in sample_rows], dtype=torch.int64).to(dev)
    step.prompt_lp = []
    for (i, start, _, targets, k), (_, own) in zip(plan.prompt_lp, wanted):
        picks = torch.tensor([at[r] for r in own], device=dev)
        step.prompt_lp.append((i, plan.so.scheduled[i].request_id, start + 1, picks, targets, k))


def _position(item: tuple[int, int, RequestState]) -> int:
    return item[0]


def _first(item: tuple[int, int, RequestState]) -> int:
    return item[0]


def _samplers(sample_rows: list[tuple[int, int, RequestState]], plan: StepPlan) -> dict[str, Any]:
    """StepInputs' per-request sampling fields, from the logits rows sorted ascending.

    Without drafts each sampling request owns one row. With drafts a request
    owns 1 + drafts rows, possibly interleaved with other requests' (decodes
    are ordered by position): ``sample_logit_rows`` lists each one's rows.
    """
    verify = plan.verify
    if not verify:
        return {
            "sample_sched_index": [i for _, i, _ in sample_rows],
            "sample_states": [st for _, _, st in sample_rows],
        }
    rows: dict[int, list[int]] = {}
    order: list[tuple[int, RequestState]] = []
    for k, (_, i, st) in enumerate(sample_rows):
        owned = rows.get(i)
        if owned is None:
            owned = rows[i] = []
            order.append((i, st))
        owned.append(k)
    drafts = []
    for i, _ in order:
        v = verify[i]
        toks = plan.tokens[i]
        drafts.append(list(toks[len(toks) - v :]) if v and toks is not None else [])
    return {
        "sample_sched_index": [i for i, _ in order],
        "sample_states": [st for _, st in order],
        "sample_drafts": drafts,
        "sample_logit_rows": [rows[i] for i, _ in order],
    }
