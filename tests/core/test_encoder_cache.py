"""The encoder cache: shared entries by content hash, references, oldest-unreferenced-first eviction."""

from __future__ import annotations

import pytest

from llmsched.core.encoder_cache import EncoderCache
from llmsched.core.encoder_inputs import EncoderScheduler
from llmsched.core.errors import RequestRejected
from llmsched.core.mm_item import MMItem
from llmsched.core.request import Request


def req(rid: str, *items: tuple[int, int, str], n: int = 400) -> Request:
    return Request(rid, [1] * n, mm_items=[MMItem(o, ln, h) for o, ln, h in items])


def test_entries_are_shared_by_hash_and_evicted_oldest_unreferenced_first():
    cache = EncoderCache(100)
    a, b = req("a", (0, 40, "x"), (50, 40, "y")), req("b", (0, 40, "x"))
    assert cache.can_allocate(a, 0, 100, 0)
    cache.allocate(a, 0)
    assert cache.hit(b, 0) and cache.num_references("x") == 2
    assert cache.can_allocate(a, 1, 100, 0)
    cache.allocate(a, 1)
    assert cache.num_free == 20
    cache.release(a)
    # x is still referenced by b: only y is evictable.
    assert cache.num_reclaimable == 60
    c = req("c", (0, 60, "z"))
    assert not cache.can_allocate(c, 0, 100, 10)  # 70 > 60 reclaimable: nothing changes
    assert "y" in cache and cache.take_evicted() == []
    assert cache.can_allocate(c, 0, 100, 0)
    assert "y" not in cache and cache.take_evicted() == ["y"]
    cache.check_invariants()


def test_budget_refuses_an_item_larger_than_what_is_left():
    cache = EncoderCache(1000)
    assert not cache.can_allocate(req("a", (0, 50, "x")), 0, 49, 0)


def test_same_image_twice_in_one_request_keeps_the_reference_until_both_pass():
    cache = EncoderCache(100)
    a = req("a", (0, 10, "x"), (20, 10, "x"))
    cache.allocate(a, 0)
    cache.hit(a, 1)
    cache.release_item(a, 0)
    assert cache.num_references("x") == 1
    cache.release_item(a, 1)
    assert cache.num_references("x") == 0 and "x" in cache
    cache.check_invariants()


def test_chunk_stops_before_an_item_that_does_not_fit():
    enc = EncoderScheduler(budget_per_step=64, cache_size=200)
    r = req("a", (10, 64, "x"), (100, 64, "y"))
    enc.begin_step()
    n, plan, held = enc.try_schedule(r, 0, 200)
    # x fits the budget, y would exceed what is left of it: stop before y.
    assert n == 100 and plan.to_encode == [0] and "budget" in held
    enc.commit(r, plan)
    assert enc.scheduled == {"a": [0]} and enc.budget == 0


def test_disable_chunked_mm_input_stops_before_a_split_item():
    enc = EncoderScheduler(budget_per_step=500, cache_size=500, chunked_items=False)
    enc.begin_step()
    n, _, held = enc.try_schedule(req("a", (30, 64, "x")), 0, 50)
    assert n == 30 and "split" in held


def test_a_prefix_hit_past_an_uncacheable_item_schedules_nothing():
    enc = EncoderScheduler(budget_per_step=10, cache_size=500)
    enc.begin_step()
    n, _, _ = enc.try_schedule(req("a", (0, 64, "x")), 32, 100)
    assert n == 0


def test_requests_with_impossible_items_are_rejected():
    enc = EncoderScheduler(budget_per_step=100, cache_size=500)
    with pytest.raises(RequestRejected, match="encoder budget"):
        enc.check_request(req("a", (0, 101, "x")))
    with pytest.raises(RequestRejected, match="sorted and disjoint"):
        enc.check_request(req("a", (50, 10, "x"), (40, 5, "y")))
    with pytest.raises(RequestRejected, match="past the"):
        enc.check_request(req("a", (395, 10, "x")))
