"""One fixed-size KV cache block as the allocator tracks it."""

from __future__ import annotations


class KVBlock:
    """A block's bookkeeping: reference count, prefix-cache hash, free-list links.

    The links live on the block itself so the free queue never allocates:
    moving a block costs a few attribute writes.
    """

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and registered in the prefix cache.
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if isinstance(self.block_hash, bytes) else self.block_hash
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"
