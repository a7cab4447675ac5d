"""Checking drafts against the target model's own choice at every drafted position.

Greedy requests keep the longest prefix of drafts equal to the target's
argmax, plus the target's token at the first mismatch (or the bonus token
after the last draft). Sampled requests use rejection sampling with the
drafts as one-hot proposals (n-gram and greedy draft models propose exactly
one token): draft ``d`` at a position whose target distribution is ``p`` is
kept with probability ``p(d)``; on rejection the token is drawn from ``p``
with ``d`` removed and renormalised. The kept-or-redrawn token is then
distributed exactly as ``p``, so speculation leaves the output distribution
unchanged.

Seeded requests draw the token at output index ``i`` from the generator
seeded with ``sample_seed(seed, i)`` (the plain sampler's stream, so a
position without drafts samples as it would without speculation), and the
acceptance test from the next draw of that generator.

All sampled requests are verified together: one filter pass, one softmax,
the drafts' probabilities gathered at once, kept lengths from a cumulative
product over a padded [requests, positions] grid, and one inverse-CDF draw
for every stop row (the rejected draft masked out there). Only the seeded
requests' uniforms are drawn request by request, each from its own stream.
"""

from __future__ import annotations

import torch

from llmsched.core.sampling_params import SamplingParams
from llmsched.executor.torch.sampler import Sampler, _inverse_cdf
from llmsched.executor.torch.seeding import sample_seed

_NEG_INF = float("-inf")


def greedy_accept(targets: list[int], drafts: list[int]) -> list[int]:
    """The tokens a greedy request keeps: drafts while they equal the target's, then the target's next."""
    out: list[int] = []
    for d, t in zip(drafts, targets):
        out.append(t)
        if d != t:
            return out
    out.append(targets[len(drafts)])
    return out


class DraftVerifier:
    """Verifies the drafts of a step's requests, given their logits rows (1 + drafts rows each)."""

    def __init__(self, sampler: Sampler) -> None:
        self.generator = sampler.generator
        self._row_generator = torch.Generator()

    def verify(
        self,
        logits: torch.Tensor,
        drafts: list[list[int]],
        params: list[SamplingParams],
        first_output_index: list[int],
    ) -> list[list[int]]:
        """Kept tokens per request; request j owns the next ``len(drafts[j]) + 1`` rows of ``logits``."""
        greedy_rows = [p.greedy for p in params]
        out: list[list[int]] = [[] for _ in drafts]
        if any(greedy_rows):
            targets = logits.max(-1).indices.tolist()
        row = 0
        random_jobs: list[tuple[int, int]] = []  # (request index, first row)
        for j, (d, g) in enumerate(zip(drafts, greedy_rows)):
            if g:
                out[j] = greedy_accept(targets[row : row + len(d) + 1], d)
            else:
                random_jobs.append((j, row))
            row += len(d) + 1
        if random_jobs:
            self._verify_random(logits, drafts, params, first_output_index, random_jobs, out)
        return out

    def _verify_random(
        self,
        logits: torch.Tensor,
        drafts: list[list[int]],
        params: list[SamplingParams],
        first_output_index: list[int],
        jobs: list[tuple[int, int]],
        out: list[list[int]],
    ) -> None:
        """Rejection sampling of every sampled request's rows at once (see the module docstring)."""
        lens = [len(drafts[j]) for j, _ in jobs]
        rows = [r for (_, first), n in zip(jobs, lens) for r in range(first, first + n + 1)]
        dev = logits.device
        sub = logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev)).float()
        Sampler.apply_filters(sub, [params[j] for (j, _), n in zip(jobs, lens) for _ in range(n + 1)])
        sub = sub.cpu()
        # Each row's draft (0 on bonus rows, whose test is never used) and its probability.
        col = torch.tensor([t for j, _ in jobs for t in (*drafts[j], 0)], dtype=torch.int64)[:, None]
        p_draft = torch.softmax(sub, -1).gather(1, col).squeeze(1)
        finite = torch.isfinite(sub)
        # Rounding can reject a draft holding all the mass: nothing else could come, so it stays.
        alone = finite.sum(-1) == finite.gather(1, col).squeeze(1).long()
        # A row keeps its draft when its acceptance uniform falls below this (2: always).
        keep_below = torch.where(alone, 2.0, p_draft)
        u = self._uniforms(jobs, lens, params, first_output_index, keep_below)
        keep = u[:, 1] < keep_below
        # Kept drafts per request: the leading run of kept rows (bonus and padding rows never count).
        pad = torch.zeros((len(jobs), max(lens) + 1), dtype=torch.bool)
        req = torch.tensor([k for k, n in enumerate(lens) for _ in range(n + 1)], dtype=torch.int64)
        pos = torch.tensor([i for n in lens for i in range(n + 1)], dtype=torch.int64)
        is_draft = pos < torch.tensor(lens, dtype=torch.int64).index_select(0, req)
        pad[req, pos] = keep & is_draft
        n_kept = pad.cumprod(1).sum(1)
        stop = torch.tensor(_firsts(lens), dtype=torch.int64) + n_kept
        # The stop row draws from its target, with the rejected draft taken out (none on a bonus row).
        last = sub.index_select(0, stop)
        c = col.index_select(0, stop)
        rejected = is_draft.index_select(0, stop)[:, None]
        last.scatter_(1, c, torch.where(rejected, _NEG_INF, last.gather(1, c)))
        tokens = _inverse_cdf(last, u.index_select(0, stop)[:, 0].contiguous()).tolist()
        for (j, _), n, t in zip(jobs, n_kept.tolist(), tokens):
            out[j] = [*drafts[j][:n], t]

    def _uniforms(
        self,
        jobs: list[tuple[int, int]],
        lens: list[int],
        params: list[SamplingParams],
        first_output_index: list[int],
        keep_below: torch.Tensor,
    ) -> torch.Tensor:
        """(sampling, acceptance) uniforms per row; a seeded request's from its own stream per output index.

        A seeded request's rows are drawn only up to its first rejection
        (``keep_below``: the acceptance bound of each row), since no row
        after it is read.
        """
        u = torch.rand((sum(lens) + len(lens), 2), generator=self.generator)
        seeded = [k for k, (j, _) in enumerate(jobs) if params[j].seed is not None]
        if not seeded:
            return u
        g = self._row_generator
        rows = u.unbind(0)
        bound = keep_below.tolist()
        firsts = _firsts(lens)
        for k in seeded:
            j = jobs[k][0]
            seed, out_index, r = params[j].seed, first_output_index[j], firsts[k]
            for i in range(lens[k] + 1):
                g.manual_seed(sample_seed(seed, out_index + i))  # type: ignore[arg-type]
                rows[r + i].uniform_(generator=g)
                if not float(rows[r + i][1]) < bound[r + i]:
                    break
        return u


def _firsts(lens: list[int]) -> list[int]:
    """Each request's first row, when request k owns ``lens[k] + 1`` rows."""
    firsts = [0]
    for n in lens[:-1]:
        firsts.append(firsts[-1] + n + 1)
    return firsts
