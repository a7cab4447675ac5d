"""The executor's encoder side: outputs computed when scheduled, kept by content hash, merged into prompts.

The scheduler decides which items to encode each step and which outputs to
evict (``SchedulerOutput.encoder_inputs`` / ``freed_encoder_ids``); this
module only follows: it runs the vision encoder on the items scheduled,
keeps their embeddings until the scheduler evicts them, and for every
chunk overlapping an item copies the embeddings of the positions the chunk
covers (a chunk may start or stop inside an item) into its input rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmsched.core.mm_item import MMItem
from llmsched.core.output import SchedulerOutput


@dataclass(slots=True)
class MMStep:
    """A step's encoder work, planned on the engine's thread."""

    freed: list[str]
    to_encode: list[MMItem]
    # (first input row, item, first embedding, end embedding) per chunk-item overlap.
    merges: list[tuple[int, MMItem, int, int]] = field(default_factory=list)


def plan_mm(
    so: SchedulerOutput, starts: list[int], counts: list[int], rows: list[int], freed: list[str]
) -> MMStep | None:
    """The encodes and merges of a step (None when it has none and frees nothing)."""
    to_encode: list[MMItem] = []
    merges: list[tuple[int, MMItem, int, int]] = []
    encode = so.encoder_inputs or {}
    for i, req in enumerate(so.scheduled):
        items = req.mm_items
        if not items:
            continue
        for k in encode.get(req.request_id, ()):
            to_encode.append(items[k])
        s, e = starts[i], starts[i] + counts[i]
        for it in items:
            lo, hi = max(s, it.offset), min(e, it.end)
            if lo < hi:
                merges.append((rows[i] + lo - s, it, lo - it.offset, hi - it.offset))
    if not (to_encode or merges or freed):
        return None
    return MMStep(freed, to_encode, merges)


class EncoderOutputs:
    """Encoder outputs by content hash, and the step's merged embeddings."""

    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> None:
        self.encode = encode
        self.device = device
        self.outputs: dict[str, torch.Tensor] = {}
        # For metrics and benchmarks: items encoded and the time spent.
        self.num_encoded = 0
        self.encode_seconds = 0.0

    def _run(self, item: MMItem) -> torch.Tensor:
        if not isinstance(item.data, torch.Tensor):
            raise ValueError(f"encoder input {item.identifier!r} carries no preprocessed pixels")
        t0 = time.perf_counter()
        out = self.encode(item.data.to(self.device))
        self.encode_seconds += time.perf_counter() - t0
        self.num_encoded += 1
        if out.shape[0] != item.length:
            raise ValueError(
                f"encoder input {item.identifier!r}: {out.shape[0]} embeddings for {item.length} placeholders"
            )
        self.outputs[item.identifier] = out
        return out

    def step(self, mm: MMStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drop evicted outputs, encode the scheduled items; (rows, embeddings) to write into the inputs."""
        outputs = self.outputs
        for h in mm.freed:
            outputs.pop(h, None)
        for it in mm.to_encode:
            if it.identifier not in outputs:
                self._run(it)
        if not mm.merges:
            return None
        rows: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        for row, it, lo, hi in mm.merges:
            emb = outputs.get(it.identifier)
            if emb is None:
                # Reserved but never encoded (its request was taken back in
                # the step that scheduled it): encode it now.
                emb = self._run(it)
            parts.append(emb[lo:hi])
            rows.append(torch.arange(row, row + hi - lo, dtype=torch.int64))
        return torch.cat(rows).to(self.device), torch.cat(parts)
