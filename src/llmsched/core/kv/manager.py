"""KVCacheManager: per-request block tables over the block pool, with prefix caching."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmsched.core.kv.block import KVBlock
from llmsched.core.kv.block_hash import BlockHasher
from llmsched.core.kv.block_pool import BlockPool
from llmsched.core.request import Request

_NO_BLOCKS: list[KVBlock] = []


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups at admission, in tokens; preempted ones counted apart."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens, all admissions together."""
        q = self.queries + self.preempted_queries
        return (self.hits + self.preempted_hits) / q if q else 0.0


class BlockTable:
    """A request's blocks in token order, and how many are registered as cached."""

    __slots__ = ("blocks", "num_cached")

    def __init__(self, blocks: list[KVBlock], num_cached: int) -> None:
        self.blocks = blocks
        self.num_cached = num_cached


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Allocates KV slots for requests and finds their prefix-cache hits.

    Every method either succeeds or leaves no trace: an allocation that does
    not fit returns None before touching the pool.
    """

    # Whether an owner may turn ``lazy_registration`` on (see __init__).
    supports_lazy_registration = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.hasher = BlockHasher(block_size, hash_algo)
        self._tables: dict[str, BlockTable] = {}
        self.stats = PrefixCacheStats()
        # Register a table's blocks after its first only once a lookup hits
        # that first block (core.kv.deferred): the same hits, less work per
        # prompt nobody shares. Off unless the owner turns it on.
        self.lazy_registration = False

    # ---- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, evictable cached ones included."""
        return self.pool.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty if it holds none)."""
        table = self._tables.get(request_id)
        return [b.block_id for b in table.blocks] if table is not None else []

    def num_held_blocks(self, request_id: str) -> int:
        """How many blocks the request holds."""
        table = self._tables.get(request_id)
        return len(table.blocks) if table is not None else 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of leading full blocks found in the cache, and its tokens.

        The hit never covers the request's last token, whose logits must be
        computed: a fully cached prompt of k blocks hits k - 1 of them when its
        length is a multiple of the block size.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return _NO_BLOCKS, 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return _NO_BLOCKS, 0
        if self.lazy_registration:
            root = self.hasher.extend(request, 1)[0]
            if self.pool.get_cached_block(root) is None:
                return _NO_BLOCKS, 0
            # A hit on the root: what was held back under it must be findable now.
            self._materialize(root)
        # One block further when the last one is full: it is registered once
        # the prefill runs, and hashing it here saves a second call then.
        hashes = self.hasher.extend(request, max_blocks + 1)
        lookup = self.pool.get_cached_block
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def blocks_to_admit(
        self,
        request: Request,
        hit_blocks: list[KVBlock],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        full_sequence: bool = False,
    ) -> int:
        """Free blocks an admission would consume (hit blocks in the free queue count)."""
        bs = self.block_size
        if full_sequence:
            num_tokens = request.num_tokens
        else:
            num_tokens = len(hit_blocks) * bs + num_new_tokens + num_lookahead_tokens
        if num_tokens > self.max_model_len:
            num_tokens = self.max_model_len
        evictable = 0
        for block in hit_blocks:
            if block.ref_cnt == 0:
                evictable += 1
        # Called twice per admission: the arithmetic inline, not through cdiv/min/max.
        more = -(-num_tokens // bs) - len(hit_blocks)
        return (more if more > 0 else 0) + evictable

    # ---- allocation ----------------------------------------------------------

    def allocate_new(
        self,
        request: Request,
        num_new_tokens: int,
        hit_blocks: list[KVBlock] = _NO_BLOCKS,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        held_for_others: int = 0,
        delay_caching: bool = False,
    ) -> list[KVBlock] | None:
        """First allocation of a waiting or preempted request, adopting its hit.

        With ``full_sequence_must_fit`` the free blocks must cover the request's
        whole current length, not only this step's chunk, so chunked prefill
        cannot admit more prompts than the cache can finish. ``reserved_blocks``
        (the watermark) must stay free after either check; ``held_for_others``
        more must stay free after this chunk's allocation (blocks promised to
        prefills in progress). ``num_new_tokens`` counts every token beyond the
        hit that gets a slot, KV loaded from elsewhere included;
        ``delay_caching`` registers none of them (their KV arrives later).
        Returns the request's whole block table, or None if it does not fit.
        """
        free = self.pool.free_queue.num_free - reserved_blocks
        if full_sequence_must_fit and self.blocks_to_admit(request, hit_blocks, 0, full_sequence=True) > free:
            return None
        if (
            self.blocks_to_admit(request, hit_blocks, num_new_tokens, num_lookahead_tokens)
            > free - held_for_others
        ):
            return None
        if hit_blocks:
            self.pool.touch(hit_blocks)
        main = len(hit_blocks) * self.block_size + num_new_tokens
        table = self._new_table(request.request_id, hit_blocks, main + num_lookahead_tokens)
        if self.enable_caching and not delay_caching:
            self._cache_full_blocks(request, table, min(main, request.num_tokens))
        return table.blocks

    def _new_table(self, request_id: str, hit_blocks: list[KVBlock], num_slots: int) -> BlockTable:
        """A first allocation's attention table (the touched hit, then new blocks), registered."""
        # Hybrid managers take their Mamba hit between the touch and the new blocks: keep this split.
        num_hit = len(hit_blocks)
        num_more = cdiv(min(num_slots, self.max_model_len), self.block_size) - num_hit
        if num_hit:
            blocks = list(hit_blocks)
            if num_more > 0:
                blocks.extend(self.pool.get_new_blocks(num_more))
        else:
            # get_new_blocks hands over a list of its own: it becomes the table.
            blocks = self.pool.get_new_blocks(num_more) if num_more > 0 else []
        table = BlockTable(blocks, num_hit)
        self._tables[request_id] = table
        return table

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[KVBlock] | None:
        """Extend a running request's table for ``num_new_tokens`` more tokens.

        Returns the blocks added (often none), or None if the pool is short.
        """
        table = self._tables[request.request_id]
        blocks = table.blocks
        computed = request.num_computed_tokens
        num_slots = computed + num_new_tokens + num_lookahead_tokens
        if num_slots > self.max_model_len:
            num_slots = self.max_model_len
        num_more = -(-num_slots // self.block_size) - len(blocks)
        if num_more > 0:
            if num_more > self.pool.free_queue.num_free:
                return None
            new_blocks = self.pool.get_new_blocks(num_more)
            blocks.extend(new_blocks)
        else:
            new_blocks = _NO_BLOCKS
        if self.enable_caching:
            # Blocks are registered as soon as their tokens are known and
            # scheduled, so requests admitted later in this very step already
            # hit them. Draft tokens are not known tokens: cap at num_tokens.
            num_known = computed + num_new_tokens
            if num_known > request.num_tokens:
                num_known = request.num_tokens
            if num_known // self.block_size > table.num_cached:
                self._cache_full_blocks(request, table, num_known)
        return new_blocks

    def next_decode_event(self, request: Request, known_lag: int = 0) -> int:
        """The computed count, after a one-token step, at which ``allocate_slots(request, 1)`` next acts.

        Below it such a call adds no block and registers none, so a caller
        that knows it may skip the call without changing anything.
        ``known_lag``: how many computed tokens are not known yet when it is
        called (async scheduling's placeholder: 1), which registers blocks
        that much later.
        """
        table = self._tables[request.request_id]
        bs = self.block_size
        at = len(table.blocks) * bs + 1
        if self.enable_caching:
            full = (table.num_cached + 1) * bs + known_lag
            if full < at:
                at = full
        return at

    def decode_blocks_needed(self, request: Request, num_steps: int) -> int:
        """Blocks ``num_steps`` more one-token steps of ``request`` would add to its table."""
        need = -(-(request.num_computed_tokens + num_steps) // self.block_size)
        have = len(self._tables[request.request_id].blocks)
        return need - have if need > have else 0

    def allocate_held(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
    ) -> list[KVBlock] | None:
        """Admit a waiting request that already holds blocks (KV loaded from elsewhere).

        The same checks as ``allocate_new``, counting the blocks it holds;
        returns its whole block table, or None if it does not fit.
        """
        table = self._tables[request.request_id]
        held = len(table.blocks)
        bs = self.block_size
        free = self.pool.free_queue.num_free - reserved_blocks
        if full_sequence_must_fit and cdiv(min(request.num_tokens, self.max_model_len), bs) - held > free:
            return None
        num_slots = min(
            request.num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        if cdiv(num_slots, bs) - held > free:
            return None
        self.allocate_slots(request, num_new_tokens, num_lookahead_tokens)
        return table.blocks

    def num_blocks_to_finish(self, request: Request, extra_tokens: int = 0) -> int:
        """Blocks the request still lacks to hold its whole current length (plus ``extra_tokens``)."""
        table = self._tables.get(request.request_id)
        held = len(table.blocks) if table is not None else 0
        num_tokens = min(request.num_tokens, self.max_model_len) + extra_tokens
        return max(cdiv(num_tokens, self.block_size) - held, 0)

    def detach(self, request: Request) -> list[KVBlock]:
        """Take the request's table away without releasing its blocks (see ``release``)."""
        table = self._tables.pop(request.request_id, None)
        return table.blocks if table is not None else []

    def release(self, blocks: list[KVBlock]) -> None:
        """Release blocks taken by ``detach``, tail first."""
        self.pool.free_blocks(reversed(blocks))

    def evict_block_ids(self, block_ids: set[int]) -> None:
        """Forget these blocks' prefix-cache entries (their KV is not valid)."""
        blocks = self.pool.blocks
        for block_id in block_ids:
            self.pool.evict(blocks[block_id])

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks among the request's first ``num_tokens`` tokens in the prefix cache."""
        table = self._tables.get(request.request_id)
        # Computed may run past the known tokens: a sync KV load that failed
        # with a step in flight (async) resets computed but not the in-flight
        # step's placeholders, padded drafts included. Only blocks whose
        # tokens are all known have a hash; vLLM caps the count the same way.
        num_tokens = min(num_tokens, request.num_tokens)
        # Called for every request in every async step: most calls complete no block.
        if self.enable_caching and table is not None and num_tokens // self.block_size > table.num_cached:
            self._cache_full_blocks(request, table, num_tokens)

    def _cache_full_blocks(self, request: Request, table: BlockTable, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = table.num_cached
        if num_full <= start:
            return
        if self.lazy_registration:
            # Block 0 now, the rest when a lookup hits block 0's hash.
            hashes = request.block_hashes
            root = hashes[0] if hashes else self.hasher.extend(request, 1)[0]
            if start == 0:
                self.pool.cache_block(table.blocks[0], root)
                start = 1
            if start < num_full:
                self.pool.defer(request, table.blocks, start, num_full, root)
            table.num_cached = num_full
            return
        hashes = self.hasher.extend(request, num_full)
        self.pool.cache_blocks(table.blocks, hashes, start, num_full)
        table.num_cached = num_full

    def _materialize(self, root: bytes) -> None:
        """Hash and register, in registration order, the still-marked blocks held back under ``root``."""
        pool = self.pool
        for seg in pool.take_deferred(root):
            hashes = self.hasher.extend(seg.request, seg.end)
            blocks = seg.blocks
            for i in range(seg.start, seg.end):
                block = blocks[i]
                if block.block_hash is seg:
                    pool.cache_block(block, hashes[i])

    def settle(self, request: Request) -> None:
        """Register what is held back under ``request``'s root now (before its tokens are rewritten)."""
        if self.lazy_registration and request.block_hashes:
            self._materialize(request.block_hashes[0])

    def mark_unwritten(self, request: Request, num_tokens: int) -> None:
        """Note that the request's cached blocks past its first ``num_tokens`` tokens hold no KV.

        For a chunk withdrawn after allocation: its blocks were registered in
        the prefix cache when allocated, but the chunk never runs. They stay
        findable, as in vLLM, so hits and every decision are unchanged; a
        request that hits one must have it recomputed (``claim_unwritten``).
        """
        table = self._tables.get(request.request_id)
        if table is not None:
            self.pool.unwritten.update(table.blocks[num_tokens // self.block_size : table.num_cached])

    def claim_unwritten(self, hit_blocks: list[KVBlock]) -> int | None:
        """Where an admitted hit stops being real KV, if it covers unwritten blocks.

        Returns the token position to recompute from (a block boundary), or
        None when every hit block holds KV. The blocks count as written from
        now on: the caller has them recomputed in this very step.
        """
        unwritten = self.pool.unwritten
        for i, block in enumerate(hit_blocks):
            if block in unwritten:
                unwritten.difference_update(hit_blocks[i:])
                return i * self.block_size
        return None

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so the tail is evicted first."""
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            self.pool.free_blocks(reversed(table.blocks))

    # ---- statistics and maintenance ----------------------------------------

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admission's lookup in the prefix-cache statistics."""
        if not self.enable_caching or request.skip_prefix_cache:
            return
        s = self.stats
        if request.num_preemptions:
            s.preempted_requests += 1
            s.preempted_queries += request.num_tokens
            s.preempted_hits += num_hit_tokens
        else:
            s.requests += 1
            s.queries += request.num_tokens
            s.hits += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; refused (False) while blocks are held."""
        return self.pool.reset_prefix_cache()

    def check_invariants(self, detached: Iterable[list[KVBlock]] = ()) -> None:
        """Assert every reference count and the free-block accounting (debug aid).

        ``detached``: tables taken by ``detach`` and not yet released.
        """
        held: dict[int, int] = {}
        for blocks in (*(t.blocks for t in self._tables.values()), *detached):
            for block in blocks:
                held[block.block_id] = held.get(block.block_id, 0) + 1
        pool = self.pool
        num_zero = 0
        for block in pool.blocks[1:]:
            n = held.get(block.block_id, 0)
            assert block.ref_cnt == n, f"{block}: ref_cnt {block.ref_cnt}, held by {n} requests"
            num_zero += block.ref_cnt == 0
        assert 0 not in held, "a request holds the null block"
        queued = sum(1 for _ in pool.free_queue)
        assert queued == pool.free_queue.num_free == num_zero, (
            f"free queue holds {queued}, counts {pool.free_queue.num_free}, {num_zero} blocks unreferenced"
        )
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert used + num_zero == pool.num_blocks - 1
