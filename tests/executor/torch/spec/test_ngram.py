"""Prompt-lookup drafts: the longest match wins, at its earliest place; capped by K and max_model_len."""

from __future__ import annotations

from llmsched.executor.torch.spec.ngram import NgramProposer


def test_continues_the_earliest_longest_match() -> None:
    p = NgramProposer(k=3, min_n=1, max_n=3, max_model_len=1000)
    # Suffix [7, 8]: "7 8" occurs at 0 (then 1 2 3) and at 5 (then 9 9 9); "6 7 8" only at 4.
    ctx = [7, 8, 1, 2, 3, 6, 7, 8, 9, 9, 9, 6, 7, 8]
    assert p.propose(ctx) == [9, 9, 9]
    # Without the 3-gram, the earliest 2-gram match wins.
    ctx2 = [7, 8, 1, 2, 3, 5, 7, 8, 9, 9, 9, 4, 7, 8]
    assert p.propose(ctx2) == [1, 2, 3]


def test_nothing_shorter_than_min_n_and_no_drafts_without_a_match() -> None:
    p = NgramProposer(k=4, min_n=2, max_n=4, max_model_len=1000)
    assert p.propose([1, 2, 3, 4, 5, 3]) == []  # only a 1-gram match
    assert p.propose([1, 2, 3, 4, 5]) == []
    assert p.propose([1, 2, 3, 1, 2]) == [3, 1, 2]  # up to the context's end (fewer than K)


def test_capped_by_k_and_max_model_len() -> None:
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert NgramProposer(k=3, min_n=2, max_n=2, max_model_len=1000).propose(ctx) == [3, 4, 5]
    assert NgramProposer(k=3, min_n=2, max_n=2, max_model_len=12).propose(ctx) == [3, 4]
    assert NgramProposer(k=3, min_n=2, max_n=2, max_model_len=10).propose(ctx) == []


def test_max_n_caps_the_match_length() -> None:
    # "0 5 1 2" matches at 4 (then 8); capped at 3 tokens, "5 1 2" matches first at 0 (then 9).
    ctx = [5, 1, 2, 9, 0, 5, 1, 2, 8, 0, 5, 1, 2]
    assert NgramProposer(k=1, min_n=1, max_n=4, max_model_len=99).propose(ctx) == [8]
    assert NgramProposer(k=1, min_n=1, max_n=3, max_model_len=99).propose(ctx) == [9]
    ctx = [1, 2, 7, 0, 5, 1, 2, 8, 0, 5, 1, 2]
    assert NgramProposer(k=1, min_n=1, max_n=2, max_model_len=99).propose(ctx) == [7]
    assert NgramProposer(k=1, min_n=1, max_n=4, max_model_len=99).propose(ctx) == [8]
