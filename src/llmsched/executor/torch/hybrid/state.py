"""Mamba states kept per block, and which state each scheduled request reads and writes in a step.

The scheduler's Mamba group hands every request state blocks out of the
same pool as attention's KV blocks (core/kv/mamba.py). The executor keeps,
for every block id, one conv state and one SSM state per Mamba layer: a
chunk reads the state of the block holding the request's last computed
position (none at position 0) and writes its final state into the block of
its own last position. With prefix caching, a cached block's state is the
state at that block's end, so a request whose prefix hit ends there starts
from it; nothing about a request lives outside the block ids, so a
preempted request simply recomputes. A hit whose blocks were never computed
(``recompute_from``) is recomputed from position 0, the state at the hit
rewritten into the hit's state block on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmsched.core.output import SchedulerOutput
from llmsched.executor.torch.hybrid.spec import MambaSpec


class MambaStatePool:
    """Per Mamba layer and block: a conv state [conv_dim, K - 1] and an SSM state [H, P, N] (float32)."""

    __slots__ = ("conv", "ssm")

    def __init__(self, spec: MambaSpec, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        layers = len(spec.mamba_layers)
        self.conv = torch.zeros(
            (layers, num_blocks, spec.conv_dim, spec.conv_kernel - 1), dtype=dtype, device=device
        )
        self.ssm = torch.zeros(
            (layers, num_blocks, spec.num_heads, spec.head_dim, spec.state_size),
            dtype=torch.float32,
            device=device,
        )


@dataclass(slots=True)
class MambaStep:
    """Per step: decodes (one row each, batched) and prefill sequences, with their state blocks.

    A source of -1 means "start from zeros" (the chunk starts at position 0).
    """

    decode_rows: torch.Tensor | None = None
    decode_src: torch.Tensor | None = None
    decode_dst: torch.Tensor | None = None
    # (first row, end row, source block or -1, destination block)
    prefills: list[tuple[int, int, int, int]] = field(default_factory=list)


def plan_mamba_step(
    so: SchedulerOutput, starts: list[int], counts: list[int], rows: list[int], device: torch.device
) -> MambaStep:
    """The step's state reads and writes, from the scheduler's per-request (source, destination) blocks.

    ``rows``: each scheduled request's first input row in the flattened step.
    """
    ids = so.mamba_state_ids
    if ids is None:
        raise RuntimeError("a hybrid model's step came without Mamba state blocks: run it with mamba=True")
    step = MambaStep()
    drows: list[int] = []
    dsrc: list[int] = []
    ddst: list[int] = []
    for req, start, n, scheduled, row in zip(so.scheduled, starts, counts, so.num_scheduled_tokens, rows):
        src, dst = ids[req.request_id]
        if dst == 0 or src == 0:
            raise RuntimeError(f"request {req.request_id!r}: its Mamba state maps to the null block")
        if n != scheduled:
            # Grown back to 0 (see recompute_from and plan_step): the hit's
            # state block was never computed either, so it is rewritten on
            # the way, for whoever hits it next.
            hit = n - scheduled
            if start != 0 or src < 0:
                raise RuntimeError(f"request {req.request_id!r}: a recomputed chunk must start at 0")
            step.prefills.append((row, row + hit, -1, src))
            step.prefills.append((row + hit, row + n, src, dst))
            continue
        if (start == 0) != (src < 0):
            raise RuntimeError(f"request {req.request_id!r}: its Mamba source block disagrees with its start")
        if n == 1 and start > 0:
            drows.append(row)
            dsrc.append(src)
            ddst.append(dst)
        else:
            step.prefills.append((row, row + n, src, dst))
    if drows:
        step.decode_rows = torch.tensor(drows, dtype=torch.int64, device=device)
        step.decode_src = torch.tensor(dsrc, dtype=torch.int64, device=device)
        step.decode_dst = torch.tensor(ddst, dtype=torch.int64, device=device)
    return step
