"""Prompt-lookup drafts: continue the longest earlier n-gram that matches the context's end.

As vLLM's n-gram proposer: among n-grams of the last ``min_n`` to
``max_n`` tokens that also occur earlier in the context (prompt and output),
take the longest, at its earliest occurrence, and propose the up to K tokens
that followed it there. Nothing found: no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    """Proposes up to ``k`` drafts per request from its own context; holds no state."""

    __slots__ = ("k", "max_len", "max_n", "min_n")

    def __init__(self, k: int, min_n: int, max_n: int, max_model_len: int) -> None:
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self.max_len = max_model_len

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Drafts following the context ``tokens`` (prompt then output), possibly none."""
        total = len(tokens)
        k = min(self.k, self.max_len - total)
        if total <= self.min_n or k <= 0:
            return []
        start = _match_end(tokens, self.min_n, self.max_n)
        if start < 0:
            return []
        return list(tokens[start : start + k])


def _match_end(tokens: Sequence[int], min_n: int, max_n: int) -> int:
    """Where the tokens after the best earlier match begin, or -1.

    Candidates are the earlier occurrences of the last token, found with
    list.index (a C scan); each is extended backwards up to ``max_n``.
    The first candidate reaching ``max_n`` is the earliest longest one.
    """
    seq = tokens if isinstance(tokens, list) else list(tokens)
    last = len(seq) - 1
    t = seq[last]
    best_len = 0
    best_end = -1
    j = -1
    while True:
        try:
            j = seq.index(t, j + 1, last)
        except ValueError:
            break
        m = 1
        limit = min(max_n, j + 1)
        while m < limit and seq[j - m] == seq[last - m]:
            m += 1
        if m > best_len:
            best_len = m
            best_end = j + 1
            if m == max_n:
                break
    return best_end if best_len >= min_n else -1
