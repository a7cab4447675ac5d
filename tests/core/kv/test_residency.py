"""Sampled KV block residency: lifetimes, idle time before eviction and reuse gaps, on a fake clock."""

from __future__ import annotations

import pytest

from llmsched.core.kv.block_pool import BlockPool
from llmsched.core.kv.residency import BlockResidency


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_block_life_ends_when_the_block_is_handed_out_again() -> None:
    clock = Clock()
    pool = BlockPool(3)
    pool.residency = BlockResidency(1.0, clock=clock)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h")
    clock.now += 1.0
    pool.free_blocks([b])
    clock.now += 2.0
    pool.touch([b])  # a prefix hit revives it
    clock.now += 0.5
    pool.touch([b])  # and a second request shares it
    clock.now += 3.0
    pool.free_blocks([b, b])
    assert pool.residency.drain() == []
    clock.now += 4.0
    # Two blocks are free: the unhashed one goes first, then the cached one is evicted.
    pool.get_new_blocks(2)
    (ev,) = pool.residency.drain()
    assert ev.lifetime == pytest.approx(10.5)
    assert ev.idle == pytest.approx(7.0)
    assert ev.reuse_gaps == pytest.approx((0.5,))
    # The new lives are tracked in turn.
    assert pool.residency.num_tracked == 2


def test_sampling_tracks_about_the_sample_rate_and_never_changes_which_block_is_handed_out() -> None:
    plain, sampled = BlockPool(2001), BlockPool(2001)
    sampled.residency = BlockResidency(0.1, seed=7)
    a = [b.block_id for b in plain.get_new_blocks(2000)]
    b = [b.block_id for b in sampled.get_new_blocks(2000)]
    assert a == b
    assert 120 < sampled.residency.num_tracked < 280


def test_a_prefix_cache_reset_forgets_tracked_lives() -> None:
    pool = BlockPool(4)
    pool.residency = BlockResidency(1.0)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.residency.num_tracked == 0
    pool.get_new_blocks(3)
    assert pool.residency.drain() == []


def test_the_sample_rate_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        BlockResidency(0.0)
    with pytest.raises(ValueError, match="sample_rate"):
        BlockResidency(1.5)
