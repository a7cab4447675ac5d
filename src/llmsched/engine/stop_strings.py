"""Finding stop strings in generated text, and how much text must wait for them."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop_string(text: str, stops: Sequence[str], boundary: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``boundary``, as (start, stop).

    Matches ending at or before ``boundary`` were looked for in an earlier
    call. When two stop strings start at the same place the one listed first
    wins.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, boundary - len(stop) + 1))
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that could be the start of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
