"""Where to cut a step's length-sorted decodes into attention groups.

Every decode of a group is padded to the group's longest context (whole KV
blocks), so each padded position costs score and value work in every
layer; each group costs a fixed set of ops per layer (its two
embedding_bag calls, the softmax, the weight and output copies). On CPU a
group's per-layer overhead (~0.1 ms, measured with SmolLM2's shapes on
one core of the development machine) is worth about ``GROUP_COST_TOKENS``
padded positions (~45 ns each at SmolLM2's and the e2e model's head
counts: ~2.5 ns per K or V row and query head), so one group
serves every decode unless splitting saves more padding than that.
Splitting happens only where the block count changes: within a run of
equal block counts there is no padding to save.
"""

from __future__ import annotations

from itertools import pairwise

# A group's fixed per-layer cost, in padded context positions.
GROUP_COST_TOKENS = 2048


def group_by_padding(widths: list[int], block_size: int) -> list[int]:
    """Group bounds [0, ..., n] over ascending block counts that minimise groups and padding.

    Cost of a group of requests [s, e): ``GROUP_COST_TOKENS`` plus
    (e - s) * widths[e - 1] * block_size positions; an exact minimum over
    cuts placed where the block count changes (a handful of runs, so the
    quadratic search is cheap).
    """
    n = len(widths)
    if n == 0:
        return [0, 0]
    cuts = [0] + [j for j in range(1, n) if widths[j] != widths[j - 1]] + [n]
    best = [0] * len(cuts)
    back = [0] * len(cuts)
    for i in range(1, len(cuts)):
        e = cuts[i]
        span = widths[e - 1] * block_size
        best[i] = -1
        for j in range(i):
            cost = best[j] + GROUP_COST_TOKENS + (e - cuts[j]) * span
            if best[i] < 0 or cost < best[i]:
                best[i], back[i] = cost, j
    bounds = [n]
    i = len(cuts) - 1
    while i:
        i = back[i]
        bounds.append(cuts[i])
    return bounds[::-1]


def split_by_byte_budget(bounds: list[int], widths: list[int], block_bytes: int, budget: int) -> list[int]:
    """``bounds`` with groups cut further so that each group's padded K (one layer) fits ``budget``."""
    out = [0]
    for s, e in pairwise(bounds):
        start = s
        for j in range(s, e):
            # Ascending, so the newest member has the longest context.
            if j > start and (j - start + 1) * widths[j] * block_bytes > budget:
                out.append(j)
                start = j
        out.append(e)
    return out
