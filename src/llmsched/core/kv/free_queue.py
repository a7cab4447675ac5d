"""Doubly linked queue of free blocks with O(1) removal from the middle."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from llmsched.core.kv.block import KVBlock
from llmsched.core.kv.deferred import Deferred


class FreeBlockQueue:
    """Free blocks in eviction order: the head is handed out first.

    A prefix-cache hit on a free block must pull it out of the middle of the
    queue, which a deque cannot do in O(1); the links are stored on the
    blocks. Two sentinel blocks remove the empty-list special cases.
    """

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.append_n(list(blocks))

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVBlock:
        """Remove and return the head block."""
        head = self._head
        block = head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        # remove(block), knowing it is linked after the head.
        nxt = block.next_free
        head.next_free = nxt
        nxt.prev_free = head
        block.prev_free = block.next_free = None
        self.num_free -= 1
        return block

    def take_n(self, n: int) -> tuple[list[KVBlock], list[KVBlock], list[bytes], list[Deferred]]:
        """Remove the first ``n`` blocks in queue order, each given a first reference and its hash taken off.

        Returns the blocks, those that carried a hash, those hashes (the
        caller drops them from the prefix-cache map), and the
        lazy-registration records whose last mark went with them (marks are
        dropped here, not listed: see core.kv.deferred). One walk instead of
        several: allocating a prompt's blocks must set their counts and clear
        what earlier requests left on them.
        """
        if n > self.num_free:
            raise IndexError(f"asked for {n} blocks, {self.num_free} free")
        out: list[KVBlock] = []
        hashed: list[KVBlock] = []
        hashes: list[bytes] = []
        gone: list[Deferred] = []
        append = out.append
        block = self._head.next_free
        # A freed table's blocks reach the head together, most carrying one
        # mark: a run of blocks with the same mark is counted off the record
        # once, where the run ends, rather than block by block.
        run: Deferred | None = None
        start = 0
        for i in range(n):
            append(block)
            block.ref_cnt = 1
            h = block.block_hash
            if h is not run:
                if run is not None:
                    run.live -= i - start
                    if not run.live:
                        gone.append(run)
                    run = None
                if h is not None:
                    block.block_hash = None
                    if type(h) is Deferred:
                        run = h
                        start = i
                    else:
                        hashed.append(block)
                        hashes.append(h)
            elif h is not None:
                block.block_hash = None
            # prev_free alone marks the block as out of the queue (see remove);
            # its stale next_free is never read.
            block.prev_free = None
            block = block.next_free
        if run is not None:
            run.live -= n - start
            if not run.live:
                gone.append(run)
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free -= n
        return out, hashed, hashes, gone

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it sits in the queue."""
        prev = block.prev_free
        if prev is None:
            # Every block out of the queue has no prev_free (take_n leaves a stale next_free).
            raise ValueError(f"{block} is not in the free queue")
        nxt = block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Put ``blocks`` at the tail, in order (evicted last)."""
        if not blocks:
            return
        last = self._tail.prev_free
        for block in blocks:
            block.prev_free = last
            last.next_free = block
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free += len(blocks)

    def release_n(self, ordered: Iterable[KVBlock], unhashed: list[KVBlock]) -> None:
        """Drop one reference on each block; those left unreferenced join the tail, in order.

        Unreferenced blocks without a hash are appended to ``unhashed``
        instead, for the caller to put at the head. One walk: a finished
        request's blocks are counted down and linked together.
        """
        blocks = ordered if type(ordered) is list else list(ordered)
        tail = self._tail
        last = tail.prev_free
        # Counted on the rarer paths; the rest were linked.
        skipped = 0
        for block in blocks:
            if block.ref_cnt == 1:
                # The last holder lets go (the common case).
                block.ref_cnt = 0
                if block.block_hash is None:
                    unhashed.append(block)
                    skipped += 1
                else:
                    block.prev_free = last
                    last.next_free = block
                    last = block
            else:
                block.ref_cnt -= 1
                skipped += 1
        last.next_free = tail
        tail.prev_free = last
        self.num_free += len(blocks) - skipped

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Put ``blocks`` at the head, keeping their order (reused first)."""
        if not blocks:
            return
        first = self._head.next_free
        prev = self._head
        for block in blocks:
            block.prev_free = prev
            prev.next_free = block
            prev = block
        prev.next_free = first
        first.prev_free = prev
        self.num_free += len(blocks)

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """Ids in queue order (for tests and debugging)."""
        return [b.block_id for b in self]
