"""Decode group bounds: one group unless splitting saves more padding than a group costs; the byte cap."""

from __future__ import annotations

import itertools

from llmsched.executor.torch.decode_groups import GROUP_COST_TOKENS, group_by_padding, split_by_byte_budget


def cost(bounds: list[int], widths: list[int], bs: int) -> int:
    return sum(GROUP_COST_TOKENS + (e - s) * widths[e - 1] * bs for s, e in itertools.pairwise(bounds))


def test_equal_contexts_make_one_group() -> None:
    assert group_by_padding([3] * 64, 128) == [0, 64]
    assert group_by_padding([], 128) == [0, 0]


def test_small_padding_is_not_worth_a_group() -> None:
    # 32 requests one block shorter than the other 32: 32 * 16 padded positions < a group's cost.
    assert group_by_padding([2] * 32 + [3] * 32, 16) == [0, 64]


def test_large_padding_splits_where_the_block_count_changes() -> None:
    widths = [1] * 40 + [8] * 24
    assert group_by_padding(widths, 128) == [0, 40, 64]


def test_bounds_are_the_cheapest_over_every_cut_set() -> None:
    widths = [1] * 10 + [2] * 5 + [4] * 12 + [5] * 3 + [8] * 20
    bs = 128
    got = group_by_padding(widths, bs)
    runs = [10, 15, 27, 30]
    best = min(
        cost([0, *cuts, 50], widths, bs)
        for r in range(len(runs) + 1)
        for cuts in itertools.combinations(runs, r)
    )
    assert cost(got, widths, bs) == best
    assert got[0] == 0 and got[-1] == 50 and got == sorted(set(got))


def test_byte_budget_cuts_groups_further() -> None:
    widths = [2] * 10
    # Each request's padded K is 2 blocks of 100 bytes: at most 3 requests fit 600 bytes.
    assert split_by_byte_budget([0, 10], widths, 100, 600) == [0, 3, 6, 9, 10]
    # A budget below one request still gives every request a group.
    assert split_by_byte_budget([0, 4, 10], widths, 100, 1) == list(range(11))
    assert split_by_byte_budget([0, 0], [], 100, 1) == [0, 0]
