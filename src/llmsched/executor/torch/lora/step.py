"""One step's adapter assignment: which rows of the flattened batch run which adapter, and the products.

Rows of the base model get nothing added. For each adapter present in the
step, its rows are gathered, shrunk to the adapter's rank and expanded back
(``(x[rows] @ A.T) @ B.T``), then added into those rows of the base
matmul's output: no weights are ever merged, so any mix of adapters and
the base model shares one batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmsched.executor.torch.lora.adapter import LoRAAdapter

# (first row, end row, adapter id): consecutive rows of one adapter.
Span = tuple[int, int, int]


def row_spans(decode_ids: Sequence[int], prefills: Sequence[tuple[int, int]]) -> list[Span]:
    """Adapter spans of a step laid out as decodes (one row each) then prefill chunks (n rows, id)."""
    spans: list[Span] = []
    row = 0
    for lid in decode_ids:
        _extend(spans, row, row + 1, lid)
        row += 1
    for n, lid in prefills:
        _extend(spans, row, row + n, lid)
        row += n
    return spans


def _extend(spans: list[Span], start: int, end: int, lid: int) -> None:
    if not lid:
        return
    if spans and spans[-1][1] == start and spans[-1][2] == lid:
        spans[-1] = (spans[-1][0], end, lid)
    else:
        spans.append((start, end, lid))


@dataclass(slots=True)
class LoRAStep:
    """The adapters of one step with their rows (None: every row of the step)."""

    groups: list[tuple[LoRAAdapter, torch.Tensor | None]]

    def apply(self, layer: int, group: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each adapter's low-rank product of ``x`` into its rows of ``y`` (in place)."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer][group]
            if pair is None:
                continue
            if rows is None:
                y.addmm_(F.linear(x, pair.a), pair.b.t())
            else:
                y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), pair.a), pair.b))


def group_rows(spans: Sequence[Span], num_rows: int) -> dict[int, list[tuple[int, int]]]:
    """Adapter id -> its row ranges, in first-seen order."""
    by_id: dict[int, list[tuple[int, int]]] = {}
    for start, end, lid in spans:
        by_id.setdefault(lid, []).append((start, end))
    return by_id


def rows_tensor(ranges: list[tuple[int, int]], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """The row indices of ``ranges`` (None when they cover all ``num_rows`` rows)."""
    if len(ranges) == 1 and ranges[0] == (0, num_rows):
        return None
    if len(ranges) == 1:
        s, e = ranges[0]
        return torch.arange(s, e, device=device)
    idx = [r for s, e in ranges for r in range(s, e)]
    return torch.tensor(idx, dtype=torch.int64).to(device)
