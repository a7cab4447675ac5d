"""Logit adjustments before sampling: min_tokens masking and repetition / frequency / presence penalties.

Semantics follow vLLM: the repetition penalty divides positive logits (and
multiplies negative ones) of every token seen in the prompt or the output;
frequency and presence penalties subtract per output occurrence / once per
output token present.
"""

from __future__ import annotations

import torch

from llmsched.core.sampling_params import SamplingParams
from llmsched.executor.torch.input_batch import RequestState


def needs_stop_mask(state: RequestState) -> bool:
    """True while EOS / stop tokens must be held back (fewer than min_tokens generated)."""
    req = state.request
    return bool(req.stop_ids) and len(state.generated) < req.min_tokens


def mask_stop_tokens(logits: torch.Tensor, rows: list[int], states: list[RequestState]) -> None:
    """Set the stop and EOS token logits of ``rows`` to -inf (in place)."""
    vocab = logits.shape[1]
    for r in rows:
        ids = [t for t in states[r].request.stop_ids if t < vocab]
        if ids:
            logits[r, ids] = float("-inf")


def has_penalties(state: RequestState) -> bool:
    """True when any penalty is active for the request."""
    p = state.request.sampling_params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _refresh_counts(state: RequestState, vocab: int, device: torch.device) -> torch.Tensor:
    """Bring the request's output-token counts up to date with its generated tokens."""
    counts = state.output_counts
    if counts is None:
        counts = state.output_counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        state.counted = 0
    generated = state.generated
    if state.counted < len(generated):
        new = [t for t in generated[state.counted :] if 0 <= t < vocab]
        if new:
            idx = torch.tensor(new, dtype=torch.int64, device=device)
            counts.index_add_(0, idx, torch.ones(len(new), dtype=torch.int32, device=device))
        state.counted = len(generated)
    return counts


def _prompt_mask(state: RequestState, vocab: int, device: torch.device) -> torch.Tensor:
    if state.prompt_mask is None:
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = [t for t in state.request.prompt_token_ids if 0 <= t < vocab]
        if ids:
            mask[torch.tensor(ids, dtype=torch.int64, device=device)] = True
        state.prompt_mask = mask
    return state.prompt_mask


def apply_penalties(logits: torch.Tensor, rows: list[int], states: list[RequestState]) -> None:
    """Apply the three penalties to ``rows`` of float32 ``logits`` (in place)."""
    vocab = logits.shape[1]
    dev = logits.device
    counts = torch.stack([_refresh_counts(states[r], vocab, dev) for r in rows])
    prompts = [_prompt_mask(states[r], vocab, dev) for r in rows]
    penalize_rows(logits, rows, counts, prompts, [states[r].request.sampling_params for r in rows])


def apply_penalties_with_drafts(
    logits: torch.Tensor, first: int, state: RequestState, drafts: list[int]
) -> None:
    """Penalise rows ``first .. first + len(drafts)``: row ``i`` counts drafts ``0..i-1`` as generated."""
    vocab = logits.shape[1]
    dev = logits.device
    base = _refresh_counts(state, vocab, dev)
    counts = base.unsqueeze(0).repeat(len(drafts) + 1, 1)
    for i, d in enumerate(drafts):
        if 0 <= d < vocab:
            counts[i + 1 :, d] += 1
    rows = list(range(first, first + len(drafts) + 1))
    prompt = _prompt_mask(state, vocab, dev)
    penalize_rows(logits, rows, counts, [prompt] * len(rows), [state.request.sampling_params] * len(rows))


def penalize_rows(
    logits: torch.Tensor,
    rows: list[int],
    counts: torch.Tensor,
    prompt_masks: list[torch.Tensor],
    params: list[SamplingParams],
) -> None:
    """The penalties on ``rows`` given each row's output-token counts and prompt token set (in place)."""
    dev = logits.device
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = logits.index_select(0, idx)
    rep = [p.repetition_penalty for p in params]
    if any(x != 1.0 for x in rep):
        seen = torch.stack(prompt_masks) | (counts > 0)
        penalty = torch.tensor(rep, dtype=sub.dtype, device=dev)[:, None]
        scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, scaled, sub)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
    sub = sub - freq * counts - pres * (counts > 0)
    logits.index_copy_(0, idx, sub)
