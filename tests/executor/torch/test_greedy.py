"""greedy_tokens picks the same index as max(-1).indices: ties, infinities, NaN, odd vocabularies."""

from __future__ import annotations

import pytest
import torch

from llmsched.executor.torch.greedy import BLOCK, greedy_tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [BLOCK * 250, BLOCK * 3, BLOCK * 2 + 5, 7])
def test_matches_max_on_random_rows(dtype: torch.dtype, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g).to(dtype)
    assert torch.equal(greedy_tokens(logits), logits.max(-1).indices)


def test_ties_pick_the_first_maximum() -> None:
    g = torch.Generator().manual_seed(0)
    # Few distinct values: every row has its maximum many times over, across blocks.
    logits = torch.randint(-3, 3, (64, BLOCK * 40), generator=g).to(torch.bfloat16)
    expected = logits.max(-1).indices
    assert torch.equal(greedy_tokens(logits), expected)
    # A later block holds a value equal to an earlier block's maximum.
    row = torch.zeros(1, BLOCK * 4)
    row[0, BLOCK * 3 + 5] = 1.0
    row[0, BLOCK + 9] = 1.0
    assert greedy_tokens(row).tolist() == [BLOCK + 9]


def test_infinities_signed_zeros_and_nan() -> None:
    logits = torch.full((4, BLOCK * 4), float("-inf"), dtype=torch.bfloat16)
    logits[1, BLOCK * 2 + 1] = float("inf")
    logits[2, 3] = -0.0
    logits[2, BLOCK + 3] = 0.0
    assert torch.equal(greedy_tokens(logits), logits.max(-1).indices)
    logits[3, BLOCK * 3 + 7] = float("nan")
    assert torch.equal(greedy_tokens(logits), logits.max(-1).indices)
    assert greedy_tokens(logits)[3].item() == BLOCK * 3 + 7


def test_non_contiguous_float_rows() -> None:
    base = torch.randn(8, BLOCK * 6)
    logits = base[:, : BLOCK * 4]
    assert torch.equal(greedy_tokens(logits), logits.max(-1).indices)
