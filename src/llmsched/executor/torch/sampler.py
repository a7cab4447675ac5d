"""Turning a step's logits into tokens: greedy, temperature, min_p, top_k, top_p, seeds, logprobs.

Order (as in vLLM): raw logprobs are taken from the unprocessed logits; then
EOS/stop tokens are masked below min_tokens, penalties applied; greedy rows
take the argmax there; random rows divide by the temperature, drop tokens
under min_p times the top probability, keep the top_k, keep the smallest
top_p nucleus, and draw by inverting the running sum of the kept
probabilities at one uniform number per row. Seeded rows draw that number
from a generator seeded with ``seeding.sample_seed(seed, output index)``;
the others share the executor's generator. Uniforms are drawn on the CPU,
so a seeded request samples the same on any device given the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmsched.core.sampling_params import SamplingParams
from llmsched.executor.torch.greedy import greedy_tokens
from llmsched.executor.torch.input_batch import RequestState
from llmsched.executor.torch.penalties import (
    apply_penalties,
    has_penalties,
    mask_stop_tokens,
    needs_stop_mask,
)
from llmsched.executor.torch.seeding import sample_seed

_NEG_INF = float("-inf")
# Top-p looks for the nucleus among this many most likely tokens before
# sorting a whole row (a full sort of a 32k vocabulary costs ~2 ms a row on CPU).
_TOP_P_CANDIDATES = 1024


@dataclass(slots=True)
class TokenLogprobs:
    """One sampled token's log-probability, its rank, and the top-N alternatives.

    Log-probabilities are of the raw model distribution (before penalties,
    temperature and filters), as vLLM reports by default. ``rank`` is 1 for
    the most likely token. ``top`` holds ``SamplingParams.logprobs`` pairs
    (token id, logprob), most likely first (empty when logprobs=0).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class Sampler:
    """Samples one token per row of the logits; one instance per executor."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        # Re-seeded for every seeded row; holds no state between draws.
        self._row_generator = torch.Generator()

    def sample(
        self, logits: torch.Tensor, states: list[RequestState]
    ) -> tuple[list[int], list[list[TokenLogprobs] | None] | None]:
        """Tokens for each row, and per-row logprobs (None when no row asked for them)."""
        params = [st.request.sampling_params for st in states]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        stop_rows = [i for i, st in enumerate(states) if needs_stop_mask(st)]
        pen_rows = [i for i, st in enumerate(states) if has_penalties(st)]
        greedy = [p.greedy for p in params]
        if all(greedy) and not want_lp and not stop_rows and not pen_rows:
            # The first maximum of each row, as max().indices, in fewer passes.
            return greedy_tokens(logits).tolist(), None

        # The model's logits are ours to modify; float() copies only bf16/fp16.
        logits = logits.float()
        raw_lp = None
        if want_lp:
            idx = torch.tensor(want_lp, dtype=torch.int64, device=logits.device)
            raw_lp = torch.log_softmax(logits.index_select(0, idx), -1)
        if stop_rows:
            mask_stop_tokens(logits, stop_rows, states)
        if pen_rows:
            apply_penalties(logits, pen_rows, states)

        tokens = greedy_tokens(logits)
        rand_rows = [i for i, g in enumerate(greedy) if not g]
        if rand_rows:
            idx = torch.tensor(rand_rows, dtype=torch.int64, device=logits.device)
            picked = self._random(logits.index_select(0, idx), [states[i] for i in rand_rows])
            tokens.index_copy_(0, idx, picked)
        out = tokens.tolist()
        if raw_lp is None:
            return out, None
        lps: list[list[TokenLogprobs] | None] = [None] * len(states)
        for j, i in enumerate(want_lp):
            lps[i] = [_token_logprobs(raw_lp[j], out[i], params[i].logprobs or 0)]
        return out, lps

    def _random(self, logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        """Sample each row of float32 ``logits`` with its request's temperature and filters."""
        params = [st.request.sampling_params for st in states]
        self.apply_filters(logits, params)
        return _inverse_cdf(logits, self._uniforms(states, params).to(logits.device))

    @staticmethod
    def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> None:
        """Temperature, min_p, top_k and top_p on float32 ``logits``, a row per entry of params (in place)."""
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
        logits.div_(temps[:, None])
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            probs = torch.softmax(logits, -1)
            floor = (
                probs.amax(-1, keepdim=True) * torch.tensor(min_ps, dtype=logits.dtype, device=dev)[:, None]
            )
            logits.masked_fill_(probs < floor, _NEG_INF)
        vocab = logits.shape[1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_ks):
            kmax = max(k for k in top_ks if k < vocab)
            values = torch.topk(logits, kmax, dim=-1).values
            kth = values.gather(1, torch.tensor([min(k, kmax) - 1 for k in top_ks], device=dev)[:, None])
            # Rows without top_k keep everything.
            kth.masked_fill_(torch.tensor([k >= vocab for k in top_ks], device=dev)[:, None], _NEG_INF)
            logits.masked_fill_(logits < kth, _NEG_INF)
        p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            _apply_top_p(logits, p_rows, [params[i].top_p for i in p_rows])

    def _uniforms(self, states: list[RequestState], params: list[SamplingParams]) -> torch.Tensor:
        """One U[0, 1) draw per row, on the CPU so seeded rows agree across devices."""
        u = torch.rand(len(params), generator=self.generator)
        g = self._row_generator
        for k, p in enumerate(params):
            if p.seed is not None:
                g.manual_seed(sample_seed(p.seed, len(states[k].generated)))
                u[k] = torch.rand(1, generator=g)
        return u


def _apply_top_p(logits: torch.Tensor, rows: list[int], top_ps: list[float]) -> None:
    """Keep, in each listed row, the most likely tokens until their mass reaches top_p (in place).

    A token goes once the strictly more likely ones already hold top_p (as
    vLLM). The nucleus is looked for among the top ``_TOP_P_CANDIDATES``
    first; only rows whose nucleus is wider pay for a full sort.
    """
    dev = logits.device
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = logits.index_select(0, idx)
    probs = torch.softmax(sub, -1)
    p = torch.tensor(top_ps, dtype=probs.dtype, device=dev)[:, None]
    k = min(_TOP_P_CANDIDATES, sub.shape[1])
    top, ids = probs.topk(k, dim=-1)
    mass = top.cumsum(-1)
    wide = (mass[:, -1:] < p).squeeze(1)
    if bool(wide.any()):
        # The nucleus spills past the candidates: sort those rows in full.
        w = wide.nonzero().squeeze(1)
        top_w, ids_w = probs.index_select(0, w).sort(-1, descending=True)
        keep_w = (top_w.cumsum(-1) - top_w) < p.index_select(0, w)
        keep = torch.zeros_like(sub, dtype=torch.bool)
        keep.index_copy_(0, w, torch.zeros_like(keep_w).scatter_(1, ids_w, keep_w))
        narrow = (~wide).nonzero().squeeze(1)
        if narrow.numel():
            keep_n = (mass - top).index_select(0, narrow) < p.index_select(0, narrow)
            rows_n = torch.zeros((narrow.numel(), sub.shape[1]), dtype=torch.bool, device=dev)
            keep.index_copy_(0, narrow, rows_n.scatter_(1, ids.index_select(0, narrow), keep_n))
    else:
        keep = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, ids, (mass - top) < p)
    logits.index_copy_(0, idx, sub.masked_fill_(~keep, _NEG_INF))


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from softmax(logits) by inverting its running sum at u * total.

    One uniform per row instead of a noise vector over the vocabulary (an
    exponential draw per logit costs more than the LM head on CPU).
    """
    weights = (logits - logits.amax(-1, keepdim=True)).exp_()
    cdf = weights.cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # Rounding can put u * total at the very top: fall back to the last token
    # the running sum still rises on, which always has a non-zero weight.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(picked, last).squeeze(1)


def _token_logprobs(row: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    """Logprob, rank and top-n of one row of raw log-probabilities."""
    lp = row[token]
    rank = int((row > lp).sum()) + 1
    top: list[tuple[int, float]] = []
    if n:
        values, ids = torch.topk(row, n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token_id=token, logprob=float(lp), rank=rank, top=top)
