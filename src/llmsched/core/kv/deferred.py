"""Prefix-cache registrations held back until a lookup could hit them.

A lookup walks a request's blocks from the first and stops at the first
miss, and a block's hash covers its whole prefix, so block i of a table can
only be hit after a hit on a block 0 with the same hash (its root). A
table's later blocks are therefore registered lazily: block 0 goes into the
map at once; the others are marked with a ``Deferred`` record filed under
the root, and hashed and registered (in registration order) only when a
lookup hits that root. Evicting a marked block just drops the mark. Every
lookup then finds what eager registration would have, while a prompt no one
shares costs one hash and one map entry instead of 64.
"""

from __future__ import annotations

from llmsched.core.kv.block import KVBlock
from llmsched.core.request import Request


class Deferred:
    """Blocks ``start <= i < end`` of a table, registered but not yet hashed into the map.

    Each such block carries this record as its ``block_hash`` until it is
    evicted or materialized; ``live`` counts those that still do.
    """

    __slots__ = ("blocks", "end", "live", "request", "root", "start")

    def __init__(self, request: Request, blocks: list[KVBlock], start: int, end: int, root: bytes) -> None:
        self.request = request
        # The table's own list: later blocks may be appended, these never change.
        self.blocks = blocks
        self.start = start
        self.end = end
        self.live = end - start
        self.root = root
