"""Prompt logprobs: each prompt token's log-probability under the logits of the position before it."""

from __future__ import annotations

import torch

from llmsched.executor.torch.sampler import TokenLogprobs


def prompt_logprobs(
    logits: torch.Tensor, step_prompt_lp: list[tuple[int, str, int, torch.Tensor, list[int], int]]
) -> dict[str, tuple[int, list[object]]]:
    """Request id -> (first prompt position, one TokenLogprobs per position), from the step's logits rows.

    Computed in float32 over the raw logits (as vLLM's default logprobs mode);
    ``rank`` is 1 + the number of tokens strictly more likely.
    """
    out: dict[str, tuple[int, list[object]]] = {}
    for _, rid, first, rows, targets, k in step_prompt_lp:
        lp = torch.log_softmax(logits.index_select(0, rows).float(), -1)
        tgt = torch.tensor(targets, dtype=torch.int64, device=lp.device)
        own = lp.gather(1, tgt[:, None])
        ranks = (lp > own).sum(1) + 1
        if k:
            top_v, top_i = lp.topk(k, -1)
            tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
        else:
            tops = [[] for _ in targets]
        entries: list[object] = [
            TokenLogprobs(token_id=t, logprob=v, rank=r, top=top)
            for t, v, r, top in zip(targets, own[:, 0].tolist(), ranks.tolist(), tops)
        ]
        out[rid] = (first, entries)
    return out
