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
the drafts' probabilities gathered at once, and one inverse-CDF draw for
every stop row (the rejected draft masked out there). What is left per
request is comparing a few floats (its kept run) and, for a seeded
request, drawing its uniforms from its own stream. A step verifies a few
rows per request, so fewer tensor ops beat padded-grid arithmetic here:
each torch call costs microseconds whatever its size.
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
        # Each row's draft (0 on bonus rows, never tested) and its probability under the target.
        # A draft holding all the mass has probability exactly 1.0, above any uniform: always kept.
        col = torch.tensor([t for j, _ in jobs for t in (*drafts[j], 0)], dtype=torch.int64)
        p_draft = torch.softmax(sub, -1).gather(1, col[:, None]).squeeze(1).tolist()
        u = self._uniforms(jobs, lens, params, first_output_index, p_draft)
        # Per request, the leading run of kept drafts (a few floats compared, no tensor op),
        # then one batched draw at every stop row.
        stops: list[int] = []
        rejected: list[int] = []
        first = 0
        for (j, _), n in zip(jobs, lens):
            k = 0
            while k < n and u[first + k][1] < p_draft[first + k]:
                k += 1
            out[j] = drafts[j][:k]
            if k < n:
                rejected.append(len(stops))
            stops.append(first + k)
            first += n + 1
        stop_rows = torch.tensor(stops, dtype=torch.int64)
        last = sub.index_select(0, stop_rows)
        if rejected:
            # A rejected draft is drawn from its row with the draft taken out.
            r = torch.tensor(rejected, dtype=torch.int64)
            last[r, col.index_select(0, stop_rows.index_select(0, r))] = _NEG_INF
        u_stop = torch.tensor([u[i][0] for i in stops], dtype=torch.float32)
        for (j, _), t in zip(jobs, _inverse_cdf(last, u_stop).tolist()):
            out[j].append(t)

    def _uniforms(
        self,
        jobs: list[tuple[int, int]],
        lens: list[int],
        params: list[SamplingParams],
        first_output_index: list[int],
        p_draft: list[float],
    ) -> list[list[float]]:
        """(sampling, acceptance) uniforms per row; a seeded request's from its own stream per output index.

        A seeded request's rows are drawn only up to its first rejection
        (a row keeps its draft when its acceptance uniform is below
        ``p_draft``), since no row after it is read.
        """
        u: list[list[float]] = torch.rand((sum(lens) + len(lens), 2), generator=self.generator).tolist()
        g = self._row_generator
        first = 0
        for (j, _), n in zip(jobs, lens):
            seed = params[j].seed
            if seed is not None:
                out_index = first_output_index[j]
                for i in range(n + 1):
                    g.manual_seed(sample_seed(seed, out_index + i))
                    u[first + i] = v = torch.rand(2, generator=g).tolist()
                    if not v[1] < p_draft[first + i]:
                        break
            first += n + 1
        return u
