"""Logits processing for requests verifying drafts: each row as if the drafts before it had been generated.

Row ``i`` of a request verifying drafts ``d_0 .. d_{n-1}`` is only used when
``d_0 .. d_{i-1}`` are all kept, so it gets exactly what the request would
get at that position without speculation: its grammar's mask after those
drafts, the raw logprobs of the masked row (the plain path masks before the
sampler too), stop tokens held back while fewer than min_tokens would have
been generated, and penalties counting those drafts as output tokens.
"""

from __future__ import annotations

import torch

from llmsched.executor.torch.input_batch import RequestState
from llmsched.executor.torch.penalties import apply_penalties_with_drafts, has_penalties
from llmsched.executor.torch.sampler import TokenLogprobs, _token_logprobs

_NEG_INF = float("-inf")


class DraftRowProcessor:
    """Applies grammars, min_tokens and penalties to drafting requests' rows, and keeps their raw logprobs."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._bitmask = None

    def process(
        self, logits: torch.Tensor, states: list[RequestState], drafts: list[list[int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None] | None]:
        """Processed logits (float32 where anything applies) and each request's raw logprob rows.

        Request ``j`` owns the next ``len(drafts[j]) + 1`` rows of ``logits``;
        its logprob rows are None unless it asked for logprobs (the whole
        list is None when none did).
        """
        firsts: list[int] = []
        row = 0
        for d in drafts:
            firsts.append(row)
            row += len(d) + 1
        spans = [
            (f, st.matcher, d)
            for f, st, d in zip(firsts, states, drafts)
            if st.matcher is not None and not st.matcher.is_terminated()
        ]
        want_lp = [st.request.sampling_params.logprobs is not None for st in states]
        stop = [bool(st.request.stop_ids) and len(st.generated) < st.request.min_tokens for st in states]
        pen = [has_penalties(st) for st in states]
        if not (spans or any(want_lp) or any(stop) or any(pen)):
            return logits, None
        # Rows selected for verification are a copy already; float() copies only bf16/fp16.
        logits = logits.float()
        if spans:
            if self._bitmask is None:
                from llmsched.structured.matcher import TokenBitmask

                self._bitmask = TokenBitmask(self.max_rows, logits.shape[1])
            self._bitmask.apply_with_drafts(logits, spans)
        raw: list[torch.Tensor | None] | None = None
        if any(want_lp):
            raw = [
                torch.log_softmax(logits[f : f + len(d) + 1], -1) if w else None
                for f, d, w in zip(firsts, drafts, want_lp)
            ]
        for f, st, d, s, p in zip(firsts, states, drafts, stop, pen):
            if s:
                _mask_stops(logits, f, st, len(d) + 1)
            if p:
                apply_penalties_with_drafts(logits, f, st, d)
        return logits, raw


def _mask_stops(logits: torch.Tensor, first: int, state: RequestState, n: int) -> None:
    """Hold stop tokens back in the request's rows still below min_tokens (drafts before counted)."""
    req = state.request
    ids = [t for t in req.stop_ids if t < logits.shape[1]]
    below = req.min_tokens - len(state.generated)
    for i in range(min(n, below)):
        if ids:
            logits[first + i, ids] = _NEG_INF


def kept_logprobs(raw: torch.Tensor, kept: list[int], n: int) -> list[TokenLogprobs]:
    """Logprobs of each kept token from the raw row at its position (the rows are the request's own)."""
    return [_token_logprobs(raw[i], t, n) for i, t in enumerate(kept)]
