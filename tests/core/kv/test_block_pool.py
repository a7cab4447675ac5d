"""BlockPool: the null block, free order, lazy eviction, touch, duplicate hashes and reset."""

from __future__ import annotations

import pytest

from llmsched.core.kv.block import KVBlock
from llmsched.core.kv.block_pool import BlockPool
from llmsched.core.request import Request


def h(name: str) -> bytes:
    """A 32-byte fake block hash."""
    return name.encode().ljust(32, b".")


def ids(blocks: list[KVBlock]) -> list[int]:
    """Block ids of a block list."""
    return [b.block_id for b in blocks]


def cached_id(pool: BlockPool, block_hash: bytes) -> int | None:
    """Id of the block a lookup of ``block_hash`` returns, or None."""
    block = pool.get_cached_block(block_hash)
    return None if block is None else block.block_id


def test_too_small_pool_refused() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_null_block_is_block_zero_and_not_free() -> None:
    pool = BlockPool(5)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.block_id == 0
    assert pool.num_free_blocks == 4
    assert pool.num_usable_blocks == 4
    assert pool.free_queue.block_ids() == [1, 2, 3, 4]


def test_null_block_never_handed_out() -> None:
    pool = BlockPool(4)
    for _ in range(5):
        got = pool.get_new_blocks(3)
        assert 0 not in ids(got)
        assert pool.num_free_blocks == 0
        with pytest.raises(IndexError):
            pool.get_new_blocks(1)
        pool.free_blocks(got)
        assert 0 not in pool.free_queue.block_ids()


def test_get_new_blocks_from_head_with_one_reference() -> None:
    pool = BlockPool(6)
    got = pool.get_new_blocks(2)
    assert ids(got) == [1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 3
    assert pool.free_queue.block_ids() == [3, 4, 5]


def test_get_new_blocks_too_many_changes_nothing() -> None:
    pool = BlockPool(4)
    with pytest.raises(IndexError):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3
    assert pool.free_queue.block_ids() == [1, 2, 3]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_usage() -> None:
    pool = BlockPool(5)
    assert pool.usage() == 0.0
    got = pool.get_new_blocks(1)
    assert pool.usage() == pytest.approx(0.25)
    pool.get_new_blocks(3)
    assert pool.usage() == pytest.approx(1.0)
    pool.free_blocks(got)
    assert pool.usage() == pytest.approx(0.75)


def test_free_unhashed_to_head_hashed_to_tail() -> None:
    pool = BlockPool(9)
    a = pool.get_new_blocks(4)  # 1, 2, 3, 4
    pool.cache_block(a[0], h("a0"))
    pool.cache_block(a[1], h("a1"))
    # Free in reverse order, as a request's table is freed.
    pool.free_blocks(list(reversed(a)))
    assert pool.free_queue.block_ids() == [4, 3, 5, 6, 7, 8, 2, 1]
    assert pool.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in a)


def test_freed_unhashed_blocks_reused_first() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)  # 1, 2
    pool.free_blocks(reversed(a))
    assert ids(pool.get_new_blocks(2)) == [2, 1]


def test_hashed_blocks_evicted_in_lru_order() -> None:
    pool = BlockPool(5)
    first = pool.get_new_blocks(2)
    second = pool.get_new_blocks(2)
    for i, b in enumerate(first + second):
        pool.cache_block(b, h(f"x{i}"))
    pool.free_blocks(reversed(first))  # freed earlier: evicted earlier
    pool.free_blocks(reversed(second))
    assert pool.free_queue.block_ids() == [2, 1, 4, 3]
    got = pool.get_new_blocks(3)
    assert ids(got) == [2, 1, 4]
    assert cached_id(pool, h("x0")) is None
    assert cached_id(pool, h("x1")) is None
    assert cached_id(pool, h("x3")) is None
    assert cached_id(pool, h("x2")) == 3


def test_shared_block_returns_to_queue_only_at_last_reference() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1
    assert b.block_id not in pool.free_queue.block_ids()
    assert pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert pool.free_queue.block_ids() == [b.block_id, 2, 3]


def test_lazy_eviction_keeps_freed_hash_findable() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h("k"))
    pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert pool.get_cached_block(h("k")) is b
    assert b.block_hash == h("k")
    assert pool.num_cached_blocks() == 1


def test_handing_out_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(3)
    got = pool.get_new_blocks(2)
    pool.cache_block(got[0], h("k0"))
    pool.cache_block(got[1], h("k1"))
    pool.free_blocks(reversed(got))  # queue: [2, 1]
    (again,) = pool.get_new_blocks(1)
    assert again is got[1]
    assert again.block_hash is None
    assert pool.get_cached_block(h("k1")) is None
    assert pool.get_cached_block(h("k0")) is got[0]
    assert pool.num_cached_blocks() == 1


def test_touch_revives_free_cached_block() -> None:
    pool = BlockPool(5)
    got = pool.get_new_blocks(2)
    pool.cache_block(got[0], h("k"))
    pool.free_blocks(reversed(got))
    assert got[0].block_id in pool.free_queue.block_ids()
    free_before = pool.num_free_blocks
    hit = pool.get_cached_block(h("k"))
    assert hit is got[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert hit.block_id not in pool.free_queue.block_ids()
    assert pool.num_free_blocks == free_before - 1
    # Revived: new allocations can no longer evict it.
    pool.get_new_blocks(pool.num_free_blocks)
    assert pool.get_cached_block(h("k")) is hit


def test_touch_held_block_only_adds_reference() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    queue_before = pool.free_queue.block_ids()
    pool.touch([b])
    pool.touch([b])
    assert b.ref_cnt == 3
    assert pool.free_queue.block_ids() == queue_before


def test_touch_several_blocks_from_anywhere_in_queue() -> None:
    pool = BlockPool(7)
    got = pool.get_new_blocks(6)
    pool.free_blocks(got)
    pool.touch([got[3], got[0], got[5]])
    assert pool.free_queue.block_ids() == [2, 3, 5]
    assert [got[i].ref_cnt for i in range(6)] == [1, 0, 0, 1, 0, 1]
    assert pool.num_free_blocks == 3


def test_duplicate_hash_returns_first_registered() -> None:
    pool = BlockPool(5)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, h("same"))
    pool.cache_block(b2, h("same"))
    assert pool.get_cached_block(h("same")) is b1
    assert pool.num_cached_blocks() == 1
    assert b1.block_hash == b2.block_hash == h("same")


def test_duplicate_hash_survives_eviction_of_first() -> None:
    pool = BlockPool(3)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, h("same"))
    pool.cache_block(b2, h("same"))
    pool.free_blocks([b1])
    assert pool.get_new_blocks(1) == [b1]
    assert b1.block_hash is None
    assert pool.get_cached_block(h("same")) is b2
    assert pool.num_cached_blocks() == 1


def test_duplicate_hash_survives_eviction_of_second() -> None:
    pool = BlockPool(3)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, h("same"))
    pool.cache_block(b2, h("same"))
    pool.free_blocks([b2])
    assert pool.get_new_blocks(1) == [b2]
    assert pool.get_cached_block(h("same")) is b1
    # Evicting the last holder forgets the hash.
    pool.free_blocks([b1])
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h("same")) is None
    assert pool.num_cached_blocks() == 0


def test_three_duplicates_evicted_in_middle() -> None:
    pool = BlockPool(4)
    b1, b2, b3 = pool.get_new_blocks(3)
    for b in (b1, b2, b3):
        pool.cache_block(b, h("same"))
    pool.evict(b2)
    assert pool.get_cached_block(h("same")) is b1
    pool.evict(b1)
    assert pool.get_cached_block(h("same")) is b3
    pool.evict(b3)
    assert pool.get_cached_block(h("same")) is None


def test_evict_forgets_hash_but_keeps_references() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h("k"))
    pool.evict(b)
    assert pool.get_cached_block(h("k")) is None
    assert b.block_hash is None
    assert b.ref_cnt == 1
    pool.evict(b)  # no hash: a no-op
    assert b.ref_cnt == 1


def test_reset_refused_while_blocks_held() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(2)
    pool.cache_block(got[0], h("k"))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h("k")) is got[0]
    assert got[0].block_hash == h("k")


def test_reset_clears_hashes_when_all_free() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(2)
    pool.cache_block(got[0], h("k0"))
    pool.cache_block(got[1], h("k1"))
    pool.free_blocks(reversed(got))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h("k0")) is None
    assert pool.get_cached_block(h("k1")) is None
    assert pool.num_cached_blocks() == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 3


@pytest.mark.parametrize("unwritten", [False, True])
def test_batched_register_and_evict_equal_one_by_one(unwritten: bool) -> None:
    """Six blocks registered and handed out again in one call each, duplicates
    among them and with the map, leave what one-block calls leave."""
    names = ["a", "b", "a", "c", "old", "a"]
    pools = []
    for batched in (True, False):
        pool = BlockPool(16)
        holder = pool.get_new_blocks(1)[0]
        pool.cache_block(holder, h("old"))  # already in the map, held elsewhere
        blocks = pool.get_new_blocks(6)
        hashes = [h(n) for n in names]
        if batched:
            pool.cache_blocks(blocks, hashes, 0, 6)
        else:
            for b, x in zip(blocks, hashes):
                pool.cache_block(b, x)
        if unwritten:
            pool.unwritten.add(blocks[1])
        seen = [(n, cached_id(pool, h(n)), pool.num_cached_blocks()) for n in names]
        pool.free_blocks(blocks)
        # Eight free after the null block and the holder: the six freed come last.
        got = pool.get_new_blocks(14) if batched else [pool.get_new_blocks(1)[0] for _ in range(14)]
        seen += [(n, cached_id(pool, h(n)), pool.num_cached_blocks()) for n in names]
        seen.append((ids(got), [b.block_hash for b in got], sorted(b.block_id for b in pool.unwritten)))
        pools.append(seen)
    assert pools[0] == pools[1]
    # The holder's hash is all that stays findable.
    assert pools[0][-2] == ("a", None, 1)


@pytest.mark.parametrize("unwritten", [False, True])
def test_handing_out_marked_blocks_in_one_call_equals_one_by_one(unwritten: bool) -> None:
    """Blocks marked by lazy registrations (some unwritten), handed out again in
    one call, leave what one-block calls leave: marks, records and the set cleared."""
    results = []
    for batched in (True, False):
        pool = BlockPool(16)
        blocks = pool.get_new_blocks(6)
        pool.cache_block(blocks[0], h("root"))
        pool.defer(Request("r", list(range(96))), blocks, 1, 4, h("root"))
        pool.defer(Request("r", list(range(96))), blocks, 4, 6, h("root"))
        other = pool.get_new_blocks(2)
        pool.cache_block(other[0], h("root2"))
        pool.defer(Request("s", list(range(32))), other, 1, 2, h("root2"))
        # A table's consecutive registrations share one record.
        assert [len(segs) for segs in pool.deferred.values()] == [1, 1]
        if unwritten:
            pool.unwritten.update([blocks[2], blocks[5], other[1]])
        pool.free_blocks(blocks + other)
        got = pool.get_new_blocks(15) if batched else [pool.get_new_blocks(1)[0] for _ in range(15)]
        results.append(
            (ids(got), [b.block_hash for b in got], sorted(b.block_id for b in pool.unwritten), pool.deferred)
        )
        assert pool.num_cached_blocks() == 0
    assert results[0] == results[1]
    assert results[0][1] == [None] * 15 and results[0][2] == [] and results[0][3] == {}
