"""Greedy token choice: the first maximum of each logits row, in two passes over blocks.

``max(-1).indices`` on a [batch, vocab] bfloat16 tensor walks each row
with an index-tracking scalar loop: ~1.7 ms for 64 rows of a 32k
vocabulary on one core of the development machine, about as long as the
LM head's matmul. Here the row is cut into blocks of ``BLOCK`` logits; the
blocks' maxima (a vectorised float32 reduction), the row's maximum, the
first block that holds it and then its first position in that block give
the same index (the first maximum, as ``max`` picks) in ~0.6 ms.

Rows holding a NaN, and vocabularies that are not a whole number of blocks
(or on devices other than the CPU), take ``max(-1).indices`` itself.
"""

from __future__ import annotations

import torch

BLOCK = 128


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row of 2-D ``logits`` (int64), as ``logits.max(-1).indices``."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % BLOCK or vocab < 2 * BLOCK:
        return logits.max(-1).indices
    blocks = logits.float().reshape(rows, vocab // BLOCK, BLOCK)
    block_max = blocks.amax(-1)
    top = block_max.amax(-1, keepdim=True)
    if bool(top.isnan().any()):
        # amax propagates NaN but == never matches it: let max pick the NaN.
        return logits.max(-1).indices
    # argmax over a 0/1 uint8 row is the first 1: the first block holding
    # the maximum, then the first position holding it inside that block.
    first_block = (block_max == top).view(torch.uint8).argmax(-1)
    candidates = blocks[torch.arange(rows, device=logits.device), first_block]
    within = (candidates == top).view(torch.uint8).argmax(-1)
    return first_block.mul_(BLOCK).add_(within)
