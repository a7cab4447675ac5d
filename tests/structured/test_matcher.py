"""Matchers over a compiled grammar and the token bitmask applied to logits rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmsched.core.structured_params import StructuredOutputsParams
from llmsched.engine.tokenizer import load_tokenizer
from llmsched.structured.manager import StructuredOutputManager
from llmsched.structured.matcher import TokenBitmask, new_matcher

VOCAB = 264
EOS = 258


@pytest.fixture
def manager(use_embedded: Path) -> StructuredOutputManager:
    tok = load_tokenizer(use_embedded)
    m = StructuredOutputManager(tok, VOCAB, [EOS])
    yield m
    m.close()


def compiled(manager: StructuredOutputManager, **kw: object) -> object:
    h = manager.grammar_for(StructuredOutputsParams(**kw))
    h.future.result(timeout=30)
    return h


def test_masked_rows_keep_only_allowed_tokens_and_others_are_untouched(manager) -> None:
    digits = new_matcher(compiled(manager, regex="[0-9]"), [])
    yes_no = new_matcher(compiled(manager, choice=["yes", "no"]), [])
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    TokenBitmask(4, VOCAB).apply(logits, [0, 2], [digits, yes_no])
    allowed0 = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
    allowed2 = set(torch.isfinite(logits[2]).nonzero().flatten().tolist())
    assert allowed0 == set(b"0123456789")
    assert allowed2 == set(b"yn")
    # Allowed logits keep their values; an unconstrained row keeps all of them.
    assert torch.equal(logits[0, 48:58], before[0, 48:58])
    assert torch.equal(logits[1], before[1])


def test_a_complete_grammar_allows_only_eos(manager) -> None:
    m = new_matcher(compiled(manager, regex="ab"), list(b"ab"))
    logits = torch.zeros(1, VOCAB)
    TokenBitmask(1, VOCAB).apply(logits, [0], [m])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]


def test_a_new_matcher_replays_the_tokens_already_generated(manager) -> None:
    # A request resumed after preemption: its matcher starts where its output is.
    h = compiled(manager, regex="[a-c]{3}")
    m = new_matcher(h, list(b"ab"))
    assert not m.is_completed()
    assert m.accept_token(ord("c")) and m.is_completed()


def _allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_draft_rows_get_the_mask_after_the_drafts_before_them(manager) -> None:
    """Row i masks as the grammar after drafts 0..i-1; the matcher ends where it started."""
    m = new_matcher(compiled(manager, regex="a[0-9]b"), [])
    logits = torch.zeros(4, VOCAB)
    TokenBitmask(4, VOCAB).apply_with_drafts(logits, [(0, m, list(b"a5b"))])
    assert _allowed(logits[0]) == {ord("a")}
    assert _allowed(logits[1]) == set(b"0123456789")
    assert _allowed(logits[2]) == {ord("b")}
    # After "a5b" only EOS (the stop token, accepted, terminates the grammar; rolled back too).
    assert _allowed(logits[3]) == {EOS}
    assert m.accept_token(ord("a")) and not m.accept_token(ord("x"))


def test_rows_after_a_refused_draft_stay_unmasked(manager) -> None:
    m = new_matcher(compiled(manager, regex="a[0-9]b"), [])
    logits = torch.zeros(4, VOCAB)
    TokenBitmask(4, VOCAB).apply_with_drafts(logits, [(0, m, [ord("a"), ord("x"), ord("b")])])
    # The refused "x" is masked out of its own row, where verification stops.
    assert ord("x") not in _allowed(logits[1])
    assert _allowed(logits[2]) == _allowed(logits[3]) == set(range(VOCAB))
    # Terminated inside the drafts: EOS drafted, so nothing after it is constrained.
    m.accept_token(ord("a"))
    m.accept_token(ord("1"))
    logits = torch.zeros(3, VOCAB)
    TokenBitmask(3, VOCAB).apply_with_drafts(logits, [(0, m, [ord("b"), EOS])])
    assert _allowed(logits[1]) == {EOS}
    assert _allowed(logits[2]) == set(range(VOCAB))
    assert not m.is_terminated() and m.accept_token(ord("b"))


class _RandomMask:
    """A stand-in matcher that writes a seeded random mask row (all-allowed when ``full``)."""

    def __init__(self, seed: int, full: bool = False) -> None:
        self.seed, self.full = seed, full

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        if self.full:
            bitmask[row].fill_(-1)
            return False
        g = torch.Generator().manual_seed(self.seed)
        bitmask[row] = torch.randint(-(2**31), 2**31 - 1, bitmask[row].shape, generator=g, dtype=torch.int32)
        return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gathered_penalty_masks_exactly_as_xgrammar(dtype: torch.dtype) -> None:
    import xgrammar as xgr

    vocab = 1000  # not a multiple of 32: the mask's last word is partly unused
    logits = torch.randn(6, vocab).to(dtype)
    rows = [0, 2, 3, 5]
    matchers = [_RandomMask(1), _RandomMask(2), _RandomMask(3, full=True), _RandomMask(4)]
    ours = logits.clone()
    TokenBitmask(8, vocab).apply(ours, rows, matchers)

    reference = logits.clone()
    bitmask = xgr.allocate_token_bitmask(8, vocab)
    masked = [r for r, m in zip(rows, matchers) if m.fill_next_token_bitmask(bitmask, r)]
    xgr.apply_token_bitmask_inplace(reference, bitmask[:6], indices=masked)
    assert torch.equal(ours, reference)
    assert torch.isinf(ours[0]).any() and not torch.isinf(ours[3]).any()
    assert torch.equal(ours[1], logits[1]) and torch.equal(ours[4], logits[4])
