"""The pool of KV blocks: allocation, reference counts and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

from llmsched.core.kv.block import KVBlock
from llmsched.core.kv.deferred import Deferred
from llmsched.core.kv.free_queue import FreeBlockQueue
from llmsched.core.kv.residency import BlockResidency
from llmsched.core.request import Request

# Fewer blocks than this are (un)registered one by one: batching costs a few
# list and set operations up front, which only pay off over several blocks.
_MIN_BATCH = 4


class BlockPool:
    """Owns every block; block 0 is the null block and is never handed out.

    Free blocks wait in ``free_queue``. A freed block that carries a hash
    stays findable in the prefix-cache map until it is handed out again
    (lazy eviction), so a later request can revive it with ``touch``.
    Identical content is never merged: two blocks may carry one hash, and a
    lookup returns the one registered first, so block tables only grow.
    """

    __slots__ = (
        "_cached",
        "blocks",
        "deferred",
        "free_queue",
        "null_block",
        "num_blocks",
        "residency",
        "unwritten",
    )

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block plus at least one")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        # hash -> the block, or a list of blocks in registration order when
        # several hold the same content (rare: only a recomputed tail block).
        self._cached: dict[bytes, KVBlock | list[KVBlock]] = {}
        # Cached blocks whose KV was never written (see KVCacheManager.mark_unwritten);
        # they leave this set when their hash goes.
        self.unwritten: set[KVBlock] = set()
        # Sampled residency metrics; None (the default) costs one test per call.
        self.residency: BlockResidency | None = None
        # Registrations held back (see core.kv.deferred), by root hash, in registration order.
        self.deferred: dict[bytes, list[Deferred]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue, including evictable cached ones."""
        return self.free_queue.num_free

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.num_blocks - 1

    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.free_queue.num_free / (self.num_blocks - 1)

    def num_cached_blocks(self) -> int:
        """Distinct hashes currently in the prefix-cache map (deferred registrations not counted)."""
        return len(self._cached)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The first-registered block holding ``block_hash``, if any."""
        hit = self._cached.get(block_hash)
        if hit is not None and type(hit) is list:
            return hit[0]
        return hit

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their hashes."""
        if n == 1:
            # A decode step's new block: the steps below for one block, without the lists.
            block = self.free_queue.popleft()
            block.ref_cnt = 1
            h = block.block_hash
            if h is not None:
                if type(h) is Deferred and not self.unwritten:
                    # Most decode blocks come off an earlier table's lazily registered run.
                    block.block_hash = None
                    self._unmark(h)
                else:
                    self._uncache(block)
            if self.residency is not None:
                self.residency.on_handed_out(block.block_id)
            return [block]
        # A 1024-token prompt takes 64 blocks, nearly all still carrying an
        # earlier request's hash: those are dropped from the map together.
        blocks, hashed, hashes, gone = self.free_queue.take_n(n)
        if self.unwritten:
            # Only blocks with a hash or a mark can be unwritten, and both go now.
            self.unwritten.difference_update(blocks)
        for seg in gone:
            self._forget(seg)
        if hashed:
            self._uncache_all(hashed, hashes)
        if self.residency is not None:
            for block in blocks:
                self.residency.on_handed_out(block.block_id)
        return blocks

    def _uncache_all(self, blocks: list[KVBlock], hashes: list[bytes]) -> None:
        """``_uncache`` each of ``blocks``, in order; ``take_n`` already took their ``hashes`` off them.

        Marks of lazy registrations are not among them: take_n dropped those.
        """
        # Batched only where it pays: a decode step takes one block at a time.
        if len(blocks) >= _MIN_BATCH and not self.unwritten:
            cached = self._cached
            popped = list(map(cached.pop, hashes, repeat(None, len(hashes))))
            # Each hash held its block alone (the common case): done. A list
            # comparison tests identity first, and KVBlock has no __eq__.
            if popped == blocks:
                return
            # Shared hashes: put the entries back, then go block by block.
            for h, cur in reversed(list(zip(hashes, popped))):
                if cur is not None:
                    cached[h] = cur
        for block, h in zip(blocks, hashes):
            block.block_hash = h
            self._uncache(block)

    def _unmark(self, seg: Deferred) -> None:
        """One block of ``seg`` lost its mark; a record with none left is dropped."""
        seg.live -= 1
        if not seg.live:
            self._forget(seg)

    def _forget(self, seg: Deferred) -> None:
        """Drop ``seg``, none of whose blocks carries its mark any more, from its root's list."""
        segs = self.deferred.get(seg.root)
        if segs is not None:
            segs.remove(seg)
            if not segs:
                del self.deferred[seg.root]

    def defer(self, request: Request, blocks: list[KVBlock], start: int, end: int, root: bytes) -> None:
        """Register ``blocks[start:end]`` of ``request``'s table lazily under root hash ``root``."""
        segs = self.deferred.get(root)
        last = segs[-1] if segs else None
        if last is not None and last.blocks is blocks and last.end == start:
            # The table's previous registration, the latest under this root,
            # ends where this one starts: one record covers both, in the same
            # registration order (a decoding request registers a block every
            # block_size tokens).
            seg = last
            seg.end = end
            seg.live += end - start
        else:
            seg = Deferred(request, blocks, start, end, root)
            if segs is None:
                self.deferred[root] = [seg]
            else:
                segs.append(seg)
        for i in range(start, end):
            blocks[i].block_hash = seg  # type: ignore[assignment]

    def take_deferred(self, root: bytes) -> list[Deferred]:
        """The registrations held back under ``root``, in order, forgotten (the caller registers them)."""
        return self.deferred.pop(root, [])

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block; a free one leaves the queue."""
        remove = self.free_queue.remove
        residency = self.residency
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1
            if residency is not None:
                residency.on_hit(block.block_id)

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; the first in ``ordered`` is evicted first.

        Blocks without a hash can never be hit, so they go to the head and are
        reused first; hashed ones go to the tail, which makes eviction LRU.
        """
        first: list[KVBlock] = []
        self.free_queue.release_n(ordered, first)
        if first:
            self.free_queue.prepend_n(first)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full block under ``block_hash``."""
        block.block_hash = block_hash
        cur = self._cached.setdefault(block_hash, block)
        if cur is not block:
            self._add_duplicate(block_hash, cur, block)

    def cache_blocks(self, blocks: list[KVBlock], hashes: list[bytes], start: int, end: int) -> None:
        """Register ``blocks[i]`` under ``hashes[i]`` for ``start <= i < end``, in order."""
        if end - start < _MIN_BATCH:
            for i in range(start, end):
                self.cache_block(blocks[i], hashes[i])
            return
        new_blocks = blocks[start:end]
        new_hashes = hashes[start:end]
        for block, h in zip(new_blocks, new_hashes):
            block.block_hash = h
        cached = self._cached
        # The common case, hashes not yet in the map: each setdefault stores
        # its block, in one pass. A list comparison tests identity first, and
        # KVBlock has no __eq__.
        got = list(map(cached.setdefault, new_hashes, new_blocks))
        if got == new_blocks:
            return
        for block, h, cur in zip(new_blocks, new_hashes, got):
            if cur is not block:
                # Re-read: an earlier duplicate among the new blocks may have made it a list.
                self._add_duplicate(h, cached[h], block)

    def _add_duplicate(self, block_hash: bytes, cur: KVBlock | list[KVBlock], block: KVBlock) -> None:
        """Register ``block`` after ``cur``, the block(s) already holding ``block_hash``."""
        if type(cur) is list:
            cur.append(block)
        else:
            self._cached[block_hash] = [cur, block]

    def _uncache(self, block: KVBlock) -> None:
        h = block.block_hash
        block.block_hash = None
        if self.unwritten:
            self.unwritten.discard(block)
        if type(h) is Deferred:
            self._unmark(h)
            return
        if self._cached.get(h) is block:
            del self._cached[h]
        else:
            self._unlist(h, block)

    def _unlist(self, block_hash: bytes, block: KVBlock) -> None:
        """Drop ``block`` from the blocks sharing ``block_hash``, if it is among them."""
        cur = self._cached.get(block_hash)
        if type(cur) is list:
            cur.remove(block)
            if len(cur) == 1:
                self._cached[block_hash] = cur[0]

    def evict(self, block: KVBlock) -> None:
        """Forget ``block``'s hash now (it keeps its place and references)."""
        if block.block_hash is not None:
            self._uncache(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any request holds a block."""
        if self.free_queue.num_free != self.num_blocks - 1:
            return False
        self._cached.clear()
        self.deferred.clear()
        self.unwritten.clear()
        if self.residency is not None:
            self.residency.reset()
        for block in self.blocks:
            block.block_hash = None
        return True
