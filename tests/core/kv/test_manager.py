"""KVCacheManager: prefix-cache lookup, side-effect-free allocation, freeing, stats and invariants."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsched.core.kv.block import KVBlock
from llmsched.core.kv.manager import KVCacheManager
from llmsched.core.request import Request

BS = 4


def make_manager(num_blocks: int = 11, max_model_len: int = 256, caching: bool = True) -> KVCacheManager:
    """A manager with block size BS; ``num_blocks`` counts the null block."""
    return KVCacheManager(num_blocks, BS, max_model_len, enable_caching=caching)


def toks(n: int, start: int = 0) -> list[int]:
    """``n`` consecutive token ids from ``start``."""
    return list(range(start, start + n))


def make_request(rid: str, tokens: list[int], **kw: object) -> Request:
    """A request over ``tokens``; keyword options go to Request."""
    return Request(rid, tokens, arrival_time=0.0, **kw)  # type: ignore[arg-type]


def admit(
    mgr: KVCacheManager,
    req: Request,
    num_new: int | None = None,
    lookahead: int = 0,
    full: bool = False,
    reserved: int = 0,
) -> list[KVBlock] | None:
    """Look up the hit and allocate as the scheduler does; on success advance computed tokens."""
    hit_blocks, hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - hit if num_new is None else num_new
    blocks = mgr.allocate_new(req, n, hit_blocks, lookahead, full, reserved)
    if blocks is not None:
        req.num_computed_tokens = hit + n
    return blocks


def decode(mgr: KVCacheManager, req: Request, token: int) -> None:
    """Append one sampled token and allocate its slot, as one decode step does."""
    req.append_output_token(token)
    assert mgr.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1


def hit_ids(mgr: KVCacheManager, req: Request) -> list[int]:
    """Block ids of the request's prefix-cache hit."""
    blocks, n = mgr.get_computed_blocks(req)
    assert n == len(blocks) * BS
    return [b.block_id for b in blocks]


def snapshot(mgr: KVCacheManager, rids: list[str]) -> dict[str, object]:
    """Everything an allocation could change: queue order, ref counts, hashes, cache map, tables."""
    pool = mgr.pool
    return {
        "queue": pool.free_queue.block_ids(),
        "num_free": mgr.num_free_blocks,
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        "cache_map": {
            b.block_hash: pool.get_cached_block(b.block_hash).block_id  # type: ignore[union-attr]
            for b in pool.blocks
            if b.block_hash is not None
        },
        "num_cached": pool.num_cached_blocks(),
        "tables": {rid: mgr.get_block_ids(rid) for rid in rids},
        "held": {rid: mgr.num_held_blocks(rid) for rid in rids},
        "stats": dataclasses.astuple(mgr.stats),
    }


# ---- lookup ----------------------------------------------------------------------


def test_second_request_hits_full_blocks_of_first() -> None:
    mgr = make_manager()
    a = make_request("a", toks(14))
    blocks = admit(mgr, a)
    assert blocks is not None
    assert len(blocks) == 4
    b = make_request("b", toks(14))
    hits, n = mgr.get_computed_blocks(b)
    assert n == 12
    assert hits == blocks[:3]


def test_admitting_with_hit_shares_blocks() -> None:
    mgr = make_manager()
    a = make_request("a", toks(14))
    admit(mgr, a)
    b = make_request("b", toks(14))
    admit(mgr, b)
    a_ids, b_ids = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    assert b_ids[:3] == a_ids[:3]
    assert b_ids[3] != a_ids[3]
    assert b.num_computed_tokens == 14
    assert [mgr.pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 2, 1]
    mgr.check_invariants()


def test_diverging_prompt_hits_common_prefix_only() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(16)))
    b_tokens = [*toks(9), 999, *toks(6, start=10)]
    assert hit_ids(mgr, make_request("b", b_tokens)) == mgr.get_block_ids("a")[:2]


def test_lookup_stops_at_first_miss() -> None:
    mgr = make_manager()
    a = make_request("a", toks(14))
    admit(mgr, a)
    table = [mgr.pool.blocks[i] for i in mgr.get_block_ids("a")]
    later_hash = table[2].block_hash
    mgr.pool.evict(table[1])
    # Block 2 is still cached, but block 1 is not: the run ends at block 1.
    assert later_hash is not None
    assert mgr.pool.get_cached_block(later_hash) is table[2]
    assert hit_ids(mgr, make_request("b", toks(14))) == [table[0].block_id]


@pytest.mark.parametrize(
    ("prompt_len", "hit_blocks"),
    [(1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3), (15, 3), (16, 3)],
)
def test_hit_never_covers_last_token(prompt_len: int, hit_blocks: int) -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(16)))
    assert mgr.pool.num_cached_blocks() == 4
    hits, n = mgr.get_computed_blocks(make_request("b", toks(prompt_len)))
    assert len(hits) == hit_blocks
    assert n == hit_blocks * BS
    assert n < prompt_len


def test_fully_cached_prompt_of_k_blocks_hits_k_minus_1() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(12)))
    b = make_request("b", toks(12))
    assert len(hit_ids(mgr, b)) == 2
    admit(mgr, b)
    # The last block is computed again, in a block of its own.
    assert b.num_computed_tokens == 12
    assert mgr.get_block_ids("b")[:2] == mgr.get_block_ids("a")[:2]
    assert mgr.get_block_ids("b")[2] != mgr.get_block_ids("a")[2]


def test_partial_blocks_never_cached_or_hit() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(6)))
    a_blocks = [mgr.pool.blocks[i] for i in mgr.get_block_ids("a")]
    assert a_blocks[0].block_hash is not None
    assert a_blocks[1].block_hash is None
    assert mgr.pool.num_cached_blocks() == 1
    assert hit_ids(mgr, make_request("b", toks(16))) == [a_blocks[0].block_id]


def test_caching_disabled_registers_and_hits_nothing() -> None:
    mgr = make_manager(caching=False)
    admit(mgr, make_request("a", toks(16)))
    assert mgr.pool.num_cached_blocks() == 0
    assert all(b.block_hash is None for b in mgr.pool.blocks)
    b = make_request("b", toks(16))
    assert mgr.get_computed_blocks(b) == ([], 0)
    mgr.record_admission(b, 0)
    assert dataclasses.astuple(mgr.stats) == (0, 0, 0, 0, 0, 0)


def test_skip_prefix_cache_gets_no_hit() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(16)))
    b = make_request("b", toks(16), skip_prefix_cache=True)
    assert mgr.get_computed_blocks(b) == ([], 0)
    mgr.record_admission(b, 0)
    assert mgr.stats.requests == 0
    # An ordinary request with the same tokens still hits.
    assert len(hit_ids(mgr, make_request("c", toks(16)))) == 3


def test_lora_requests_do_not_share_cache_with_base() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(16)))
    assert hit_ids(mgr, make_request("b", toks(16), lora_id=1)) == []
    admit(mgr, make_request("c", toks(16), lora_id=1))
    assert len(hit_ids(mgr, make_request("d", toks(16), lora_id=1))) == 3
    assert hit_ids(mgr, make_request("e", toks(16), lora_id=2)) == []


def test_cache_salt_separates_tenants() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(16), cache_salt="t1"))
    assert hit_ids(mgr, make_request("b", toks(16))) == []
    assert hit_ids(mgr, make_request("c", toks(16), cache_salt="t2")) == []
    assert hit_ids(mgr, make_request("d", toks(16), cache_salt="t1")) == mgr.get_block_ids("a")[:3]


# ---- registration at allocation ------------------------------------------------


def test_blocks_registered_as_soon_as_allocated() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(14)))
    # Nothing was computed yet; the lookup right after the allocation hits.
    assert len(hit_ids(mgr, make_request("b", toks(14)))) == 3


def test_chunked_allocation_registers_only_scheduled_full_blocks() -> None:
    mgr = make_manager()
    a = make_request("a", toks(16))
    blocks = admit(mgr, a, num_new=6)
    assert blocks is not None
    assert len(blocks) == 2
    assert [b.block_hash is not None for b in blocks] == [True, False]
    b = make_request("b", toks(16))
    assert hit_ids(mgr, b) == [blocks[0].block_id]
    new = mgr.allocate_slots(a, 6)
    assert new is not None
    assert len(new) == 1
    a.num_computed_tokens += 6
    assert mgr.pool.num_cached_blocks() == 3
    assert hit_ids(mgr, b) == mgr.get_block_ids("a")[:3]


def test_lookahead_slots_allocated_but_not_cached() -> None:
    mgr = make_manager()
    a = make_request("a", toks(8))
    blocks = admit(mgr, a, lookahead=4)
    assert blocks is not None
    assert len(blocks) == 3
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert mgr.pool.num_cached_blocks() == 2


def test_draft_tokens_allocate_slots_but_are_not_cached() -> None:
    mgr = make_manager()
    a = make_request("a", toks(7))
    admit(mgr, a)
    assert mgr.pool.num_cached_blocks() == 1
    a.append_output_token(7)  # 8 known tokens, 7 computed
    # One real token plus four drafts: slots up to 12, known tokens only up to 8.
    new = mgr.allocate_slots(a, 1 + 4)
    assert new is not None
    assert len(new) == 1
    table = [mgr.pool.blocks[i] for i in mgr.get_block_ids("a")]
    assert [b.block_hash is not None for b in table] == [True, True, False]
    assert mgr.pool.num_cached_blocks() == 2


def test_cache_blocks_past_the_known_tokens_registers_only_known_full_blocks() -> None:
    """Computed can run past the known tokens (a failed KV load); only known full blocks get a hash."""
    mgr = make_manager()
    a = make_request("a", toks(7))
    admit(mgr, a)
    a.append_output_token(7)  # 8 known tokens
    assert mgr.allocate_slots(a, 1 + 8) is not None  # slots up to 16
    mgr.cache_blocks(a, 16)
    table = [mgr.pool.blocks[i] for i in mgr.get_block_ids("a")]
    assert [b.block_hash is not None for b in table] == [True, True, False, False]
    assert mgr.pool.num_cached_blocks() == 2


def test_allocate_slots_returns_only_new_blocks() -> None:
    mgr = make_manager()
    a = make_request("a", toks(6))
    admit(mgr, a)
    assert mgr.num_held_blocks("a") == 2
    assert mgr.allocate_slots(a, 2) == []
    assert mgr.num_held_blocks("a") == 2
    a.num_computed_tokens = 8
    new = mgr.allocate_slots(a, 1)
    assert new is not None
    assert len(new) == 1
    assert mgr.get_block_ids("a")[-1] == new[0].block_id


def test_slots_capped_by_max_model_len() -> None:
    mgr = make_manager(max_model_len=10)
    a = make_request("a", toks(8))
    blocks = admit(mgr, a, lookahead=8)
    assert blocks is not None
    assert len(blocks) == 3  # ceil(min(16, 10) / 4)
    assert mgr.allocate_slots(a, 2, 8) == []
    assert mgr.num_held_blocks("a") == 3


# ---- failed allocations -----------------------------------------------------------


def crowded_manager() -> tuple[KVCacheManager, Request]:
    """7 usable blocks: 'x' (14 tokens) freed with 3 cached blocks, 'y' (8 tokens) running.

    Free queue afterwards: [6, 7, 3, 2, 1], blocks 1-3 cached and evictable.
    """
    mgr = make_manager(num_blocks=8)
    x = make_request("x", toks(14))
    admit(mgr, x)
    mgr.free(x)
    y = make_request("y", toks(8, start=500))
    admit(mgr, y)
    assert mgr.get_block_ids("y") == [4, 5]
    assert mgr.pool.free_queue.block_ids() == [6, 7, 3, 2, 1]
    return mgr, y


def test_failed_admission_leaves_no_trace() -> None:
    mgr, _ = crowded_manager()
    z = make_request("z", toks(14) + toks(10, start=900))
    hits, n = mgr.get_computed_blocks(z)
    assert [b.block_id for b in hits] == [1, 2, 3]
    before = snapshot(mgr, ["x", "y", "z"])
    # 3 new blocks plus the 3 evictable hit blocks: 6 > 5 free.
    assert mgr.allocate_new(z, z.num_tokens - n, hits) is None
    assert snapshot(mgr, ["x", "y", "z"]) == before
    assert mgr.get_block_ids("z") == []
    mgr.check_invariants()


def test_failed_full_sequence_check_leaves_no_trace() -> None:
    mgr, _ = crowded_manager()
    z = make_request("z", toks(14) + toks(10, start=900))
    hits, _ = mgr.get_computed_blocks(z)
    before = snapshot(mgr, ["y", "z"])
    assert mgr.allocate_new(z, 4, hits, full_sequence_must_fit=True) is None
    assert snapshot(mgr, ["y", "z"]) == before
    # Without the whole-sequence rule the 4-token chunk fits.
    blocks = mgr.allocate_new(z, 4, hits)
    assert blocks is not None
    assert [b.block_id for b in blocks] == [1, 2, 3, 6]
    mgr.check_invariants()


def test_failed_watermark_check_leaves_no_trace() -> None:
    mgr, _ = crowded_manager()
    z = make_request("z", toks(14) + toks(10, start=900))
    hits, _ = mgr.get_computed_blocks(z)
    assert mgr.blocks_to_admit(z, hits, 4) == 4
    before = snapshot(mgr, ["y", "z"])
    assert mgr.allocate_new(z, 4, hits, reserved_blocks=2) is None
    assert snapshot(mgr, ["y", "z"]) == before
    # Exactly the reserve left over is fine.
    assert mgr.allocate_new(z, 4, hits, reserved_blocks=1) is not None
    assert mgr.num_free_blocks == 1


def test_failed_allocate_slots_leaves_no_trace() -> None:
    mgr, y = crowded_manager()
    before = snapshot(mgr, ["y"])
    assert mgr.allocate_slots(y, 30) is None
    assert snapshot(mgr, ["y"]) == before
    # Exactly the free blocks: succeeds, evicting the cached ones.
    new = mgr.allocate_slots(y, 5 * BS)
    assert new is not None
    assert [b.block_id for b in new] == [6, 7, 3, 2, 1]
    assert mgr.pool.num_cached_blocks() == 2  # only y's own blocks
    mgr.check_invariants()


# ---- what an admission needs -------------------------------------------------------


def test_full_sequence_reservation() -> None:
    mgr = make_manager(num_blocks=4)  # 3 usable
    a = make_request("a", toks(20))  # 5 blocks in all
    assert mgr.blocks_to_admit(a, [], 0, full_sequence=True) == 5
    assert mgr.blocks_to_admit(a, [], 8) == 2
    assert admit(mgr, a, num_new=8, full=True) is None
    assert mgr.num_free_blocks == 3
    blocks = admit(mgr, a, num_new=8, full=False)
    assert blocks is not None
    assert len(blocks) == 2


def test_full_sequence_capped_by_max_model_len() -> None:
    mgr = make_manager(max_model_len=12)
    a = make_request("a", toks(20))
    assert mgr.blocks_to_admit(a, [], 0, full_sequence=True) == 3


@pytest.mark.parametrize(("reserved", "fits"), [(0, True), (4, True), (5, False), (10, False)])
def test_reserved_blocks_watermark(reserved: int, fits: bool) -> None:
    mgr = make_manager(num_blocks=11)  # 10 usable
    a = make_request("a", toks(24))  # 6 blocks
    blocks = admit(mgr, a, reserved=reserved)
    assert (blocks is not None) is fits
    assert mgr.num_free_blocks == (4 if fits else 10)


def test_free_hit_blocks_count_as_needed() -> None:
    mgr = make_manager(num_blocks=5)  # 4 usable
    a = make_request("a", toks(14))
    admit(mgr, a)
    mgr.free(a)
    # c takes the head of the queue: a's unhashed partial block.
    c = make_request("c", toks(2, start=700))
    assert admit(mgr, c) is not None
    assert mgr.get_block_ids("c") == [4]
    b = make_request("b", toks(14))
    hits, n = mgr.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2, 3]
    # 1 new block, and the 3 hit blocks must leave the free queue too.
    assert mgr.blocks_to_admit(b, hits, b.num_tokens - n) == 4
    before = snapshot(mgr, ["b", "c"])
    assert mgr.allocate_new(b, b.num_tokens - n, hits) is None
    assert snapshot(mgr, ["b", "c"]) == before
    mgr.free(c)
    blocks = mgr.allocate_new(b, b.num_tokens - n, hits)
    assert blocks is not None
    assert [blk.block_id for blk in blocks] == [1, 2, 3, 4]
    mgr.check_invariants()


def test_held_hit_blocks_do_not_count_as_needed() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(14)))
    b = make_request("b", toks(14))
    hits, n = mgr.get_computed_blocks(b)
    assert mgr.blocks_to_admit(b, hits, b.num_tokens - n) == 1


def test_mixed_held_and_free_hit_blocks() -> None:
    mgr = make_manager()
    a = make_request("a", toks(14))
    admit(mgr, a)
    long = make_request("long", toks(24))
    admit(mgr, long)  # hits a's 3 blocks, adds 3 more
    mgr.free(long)
    b = make_request("b", toks(24))
    hits, n = mgr.get_computed_blocks(b)
    assert len(hits) == 5
    # 3 hit blocks still held by a, 2 free; 1 new block.
    assert mgr.blocks_to_admit(b, hits, b.num_tokens - n) == 1 + 2


# ---- freeing ---------------------------------------------------------------------


def test_free_returns_blocks_in_reverse_order_unhashed() -> None:
    mgr = make_manager(num_blocks=8, caching=False)
    a = make_request("a", toks(14))
    admit(mgr, a)
    assert mgr.get_block_ids("a") == [1, 2, 3, 4]
    mgr.free(a)
    assert mgr.pool.free_queue.block_ids() == [4, 3, 2, 1, 5, 6, 7]
    assert mgr.get_block_ids("a") == []
    assert mgr.num_held_blocks("a") == 0


def test_free_returns_hashed_blocks_tail_first_to_tail() -> None:
    mgr = make_manager(num_blocks=8)
    a = make_request("a", toks(14))
    admit(mgr, a)
    mgr.free(a)
    # Partial block 4 to the head; the cached 3, 2, 1 to the tail, the last block evicted first.
    assert mgr.pool.free_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert mgr.num_free_blocks == 7
    assert len(hit_ids(mgr, make_request("b", toks(14)))) == 3


def test_eviction_takes_tail_of_freed_prefix_first() -> None:
    mgr = make_manager(num_blocks=5)
    a = make_request("a", toks(16))
    admit(mgr, a)
    mgr.free(a)
    assert mgr.pool.free_queue.block_ids() == [4, 3, 2, 1]
    admit(mgr, make_request("c", toks(4, start=900)))  # evicts block 4
    b = make_request("b", toks(16))
    assert hit_ids(mgr, b) == [1, 2, 3]
    admit(mgr, make_request("d", toks(4, start=950)))  # evicts block 3
    assert hit_ids(mgr, b) == [1, 2]


def test_free_shared_blocks_keeps_them_for_other_holder() -> None:
    mgr = make_manager()
    a = make_request("a", toks(14))
    b = make_request("b", toks(14))
    admit(mgr, a)
    admit(mgr, b)
    shared = mgr.get_block_ids("a")[:3]
    mgr.free(a)
    assert all(mgr.pool.blocks[i].ref_cnt == 1 for i in shared)
    assert not set(shared) & set(mgr.pool.free_queue.block_ids())
    mgr.check_invariants()


def test_free_unknown_request_is_a_noop() -> None:
    mgr = make_manager()
    before = snapshot(mgr, [])
    mgr.free(make_request("ghost", toks(4)))
    assert snapshot(mgr, []) == before


def test_freed_request_can_be_readmitted_from_cache() -> None:
    mgr = make_manager()
    a = make_request("a", toks(10))
    admit(mgr, a)
    for t in range(100, 106):
        decode(mgr, a, t)
    assert a.num_tokens == 16
    assert mgr.pool.num_cached_blocks() == 4
    old = mgr.get_block_ids("a")
    mgr.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions += 1
    assert hit_ids(mgr, a) == old[:3]


def test_duplicate_block_content_not_deduplicated_and_survives_eviction() -> None:
    mgr = make_manager(num_blocks=6)  # 5 usable
    a = make_request("a", toks(8))
    admit(mgr, a)
    b = make_request("b", toks(8))
    admit(mgr, b)
    a_ids, b_ids = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    assert b_ids[0] == a_ids[0]
    assert b_ids[1] != a_ids[1]
    a_last, b_last = mgr.pool.blocks[a_ids[1]], mgr.pool.blocks[b_ids[1]]
    assert a_last.block_hash == b_last.block_hash is not None
    assert mgr.pool.get_cached_block(a_last.block_hash) is a_last
    assert mgr.pool.num_cached_blocks() == 2
    # Evict a's copy: b's copy is found from then on.
    mgr.free(a)
    assert mgr.pool.free_queue.block_ids() == [4, 5, a_last.block_id]
    # c takes every free block; a's copy becomes c's partial last block.
    admit(mgr, make_request("c", toks(9, start=900)))
    assert mgr.get_block_ids("c")[-1] == a_last.block_id
    assert a_last.block_hash is None
    d = make_request("d", toks(9))
    assert hit_ids(mgr, d) == [a_ids[0], b_ids[1]]


# ---- statistics -----------------------------------------------------------------


def test_prefix_stats_new_and_preempted_apart() -> None:
    mgr = make_manager()
    a = make_request("a", toks(14))
    admit(mgr, a)
    mgr.record_admission(a, 0)
    b = make_request("b", toks(14))
    _, hit = mgr.get_computed_blocks(b)
    admit(mgr, b)
    mgr.record_admission(b, hit)
    s = mgr.stats
    assert (s.requests, s.queries, s.hits) == (2, 28, 12)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (0, 0, 0)
    mgr.free(b)
    b.num_computed_tokens = 0
    b.num_preemptions = 1
    _, hit = mgr.get_computed_blocks(b)
    mgr.record_admission(b, hit)
    assert (s.requests, s.queries, s.hits) == (2, 28, 12)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 14, 12)
    assert s.hit_rate == pytest.approx(24 / 42)


def test_prefix_stats_empty_hit_rate() -> None:
    assert make_manager().stats.hit_rate == 0.0


# ---- reset and invariants -----------------------------------------------------------


def test_reset_prefix_cache_refused_while_blocks_held() -> None:
    mgr = make_manager()
    a = make_request("a", toks(14))
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    assert len(hit_ids(mgr, make_request("b", toks(14)))) == 3
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert hit_ids(mgr, make_request("c", toks(14))) == []
    assert mgr.pool.num_cached_blocks() == 0
    assert all(b.block_hash is None for b in mgr.pool.blocks)
    assert mgr.num_free_blocks == 10


def test_usage() -> None:
    mgr = make_manager(num_blocks=5)
    assert mgr.usage == 0.0
    a = make_request("a", toks(6))
    admit(mgr, a)
    assert mgr.usage == pytest.approx(0.5)
    mgr.free(a)
    assert mgr.usage == 0.0


def test_unknown_request_holds_nothing() -> None:
    mgr = make_manager()
    assert mgr.get_block_ids("nope") == []
    assert mgr.num_held_blocks("nope") == 0


def test_check_invariants_passes_on_valid_states() -> None:
    mgr = make_manager()
    mgr.check_invariants()
    a, b = make_request("a", toks(14)), make_request("b", toks(14))
    admit(mgr, a)
    mgr.check_invariants()
    admit(mgr, b)
    mgr.check_invariants()
    decode(mgr, a, 55)
    mgr.check_invariants()
    mgr.free(a)
    mgr.check_invariants()
    mgr.free(b)
    mgr.check_invariants()


def test_check_invariants_catches_extra_reference() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(14)))
    mgr.pool.blocks[mgr.get_block_ids("a")[0]].ref_cnt += 1
    with pytest.raises(AssertionError):
        mgr.check_invariants()


def test_check_invariants_catches_missing_reference() -> None:
    mgr = make_manager()
    admit(mgr, make_request("a", toks(14)))
    admit(mgr, make_request("b", toks(14)))
    mgr.pool.blocks[mgr.get_block_ids("a")[0]].ref_cnt -= 1
    with pytest.raises(AssertionError):
        mgr.check_invariants()


def test_check_invariants_catches_referenced_free_block() -> None:
    mgr = make_manager()
    free_block = mgr.pool.blocks[mgr.pool.free_queue.block_ids()[0]]
    free_block.ref_cnt = 1
    with pytest.raises(AssertionError):
        mgr.check_invariants()


# ---- random operation sequences -----------------------------------------------------

PREFIXES = [toks(16), toks(16, start=200), toks(8) + toks(8, start=300)]
OP = st.tuples(
    st.sampled_from(["admit", "decode", "free"]),
    st.integers(0, 5),
    st.integers(0, 2),
    st.integers(1, 16),
)


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(OP, max_size=30))
def test_random_operations_keep_invariants(ops: list[tuple[str, int, int, int]]) -> None:
    mgr = make_manager(num_blocks=13)
    live: dict[str, Request] = {}
    serial = 0
    for op, which, prefix, length in ops:
        rid = f"r{which}"
        if op == "admit" and rid not in live:
            serial += 1
            req = make_request(rid, [*PREFIXES[prefix][:length], 1000 + serial])
            hits, n = mgr.get_computed_blocks(req)
            assert n < req.num_tokens
            before = snapshot(mgr, list(live))
            blocks = mgr.allocate_new(req, req.num_tokens - n, hits)
            if blocks is None:
                assert snapshot(mgr, list(live)) == before
            else:
                req.num_computed_tokens = req.num_tokens
                live[rid] = req
                assert 0 not in mgr.get_block_ids(rid)
        elif op == "decode" and rid in live:
            req = live[rid]
            req.append_output_token(2000 + length)
            before = snapshot(mgr, list(live))
            if mgr.allocate_slots(req, 1) is None:
                assert snapshot(mgr, list(live)) == before
                mgr.free(req)
                del live[rid]
            else:
                req.num_computed_tokens += 1
                assert 0 not in mgr.get_block_ids(rid)
        elif op == "free" and rid in live:
            mgr.free(live.pop(rid))
        mgr.check_invariants()
        assert mgr.num_free_blocks + len({i for r in live for i in mgr.get_block_ids(r)}) == 12


# ---- blocks registered by a chunk that never ran -------------------------------------


def test_unwritten_blocks_stay_findable_and_are_claimed_once() -> None:
    mgr = make_manager(num_blocks=20)
    a = make_request("a", toks(5 * BS + 1))
    assert admit(mgr, a) is not None  # registers 5 full blocks
    a_blocks = mgr.get_block_ids("a")
    # Only 3 blocks' worth of tokens really ran: the last two are unwritten.
    mgr.mark_unwritten(a, 3 * BS)
    assert {b.block_id for b in mgr.pool.unwritten} == set(a_blocks[3:5])
    mgr.free(a)
    b = make_request("b", toks(5 * BS + 1))
    hit_blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 5 * BS  # decisions see the same hit as before
    assert mgr.claim_unwritten(hit_blocks) == 3 * BS
    assert not mgr.pool.unwritten
    assert mgr.claim_unwritten(hit_blocks) is None


def test_a_hit_short_of_the_unwritten_blocks_claims_nothing() -> None:
    mgr = make_manager(num_blocks=20)
    a = make_request("a", toks(5 * BS + 1))
    admit(mgr, a)
    mgr.mark_unwritten(a, 4 * BS)
    mgr.free(a)
    c = make_request("c", toks(2 * BS + 1))  # shares only the first two blocks
    hit_blocks, hit = mgr.get_computed_blocks(c)
    assert hit == 2 * BS
    assert mgr.claim_unwritten(hit_blocks) is None
    assert len(mgr.pool.unwritten) == 1


def test_evicting_an_unwritten_block_forgets_it() -> None:
    mgr = make_manager(num_blocks=7)  # 6 usable blocks
    a = make_request("a", toks(2 * BS + 1))
    admit(mgr, a)
    mgr.mark_unwritten(a, 0)
    assert len(mgr.pool.unwritten) == 2
    mgr.free(a)
    # A request that needs every block reuses (and evicts) a's cached ones.
    big = make_request("big", toks(6 * BS, start=9000))
    assert admit(mgr, big) is not None
    assert not mgr.pool.unwritten
    mgr.check_invariants()


def test_reset_forgets_unwritten_blocks() -> None:
    mgr = make_manager()
    a = make_request("a", toks(2 * BS + 1))
    admit(mgr, a)
    mgr.mark_unwritten(a, 0)
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert not mgr.pool.unwritten
