"""Per-request grammar matchers and the token bitmask they fill, for an executor's sampling step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def new_matcher(grammar: Any, output_token_ids: Sequence[int]) -> Any:
    """A matcher at the start of ``grammar`` (a GrammarHandle), advanced over the tokens already generated."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar.compiled)
    for t in output_token_ids:
        if not matcher.accept_token(t):
            break
    return matcher


class TokenBitmask:
    """One bitmask row per logits row; filled from each constrained row's matcher, then applied in place."""

    __slots__ = ("_bitmask", "_xgr")

    def __init__(self, max_rows: int, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Fill the rows' masks from their matchers and set every disallowed logit to -inf."""
        bitmask = self._bitmask
        # Rows whose grammar allows every token need no masking.
        masked = [row for row, m in zip(rows, matchers) if m.fill_next_token_bitmask(bitmask, row)]
        if masked:
            n = logits.shape[0]
            self._xgr.apply_token_bitmask_inplace(logits, bitmask[:n].to(logits.device), indices=masked)
