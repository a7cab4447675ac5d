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
        rows = [r for j, first in jobs for r in range(first, first + len(drafts[j]) + 1)]
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        sub = logits.index_select(0, idx).float()
        Sampler.apply_filters(sub, [params[j] for j, _ in jobs for _ in range(len(drafts[j]) + 1)])
        sub = sub.cpu()
        probs = torch.softmax(sub, -1)
        k = 0
        for j, _ in jobs:
            d = drafts[j]
            out[j] = self._accept(
                sub[k : k + len(d) + 1], probs[k : k + len(d) + 1], d, params[j].seed, first_output_index[j]
            )
            k += len(d) + 1

    def _accept(
        self, logits: torch.Tensor, probs: torch.Tensor, drafts: list[int], seed: int | None, first: int
    ) -> list[int]:
        """Rejection sampling for one request's rows (filtered float32 logits and their softmax)."""
        kept: list[int] = []
        for i, d in enumerate(drafts):
            u_sample, u_accept = self._draws(seed, first + i)
            if u_accept < float(probs[i, d]):
                kept.append(d)
                continue
            row = logits[i : i + 1].clone()
            row[0, d] = _NEG_INF
            if bool(torch.isinf(row).all()):
                # Rounding rejected a draft holding all the mass: nothing else can come.
                kept.append(d)
                continue
            kept.append(int(_inverse_cdf(row, torch.tensor([u_sample]))[0]))
            return kept
        u_sample, _ = self._draws(seed, first + len(drafts), accept=False)
        kept.append(int(_inverse_cdf(logits[len(drafts) :], torch.tensor([u_sample]))[0]))
        return kept

    def _draws(self, seed: int | None, output_index: int, accept: bool = True) -> tuple[float, float]:
        """(sampling uniform, acceptance uniform) for one output index."""
        if seed is None:
            g = self.generator
        else:
            g = self._row_generator
            g.manual_seed(sample_seed(seed, output_index))
        u = float(torch.rand(1, generator=g))
        return u, float(torch.rand(1, generator=g)) if accept else 0.0
