"""Mamba state blocks: a hybrid model's per-request recurrent state on the shared block pool.

A Mamba layer keeps one fixed-size state per request instead of a growing
KV cache. Its group's block table is indexed like attention's (slot ``i``
covers tokens ``[i * bs, (i + 1) * bs)``) but only the slot of the latest
computed position holds a live state; earlier slots are the null block.

- **align** mode (prefix caching on): a chunk's state is written to the slot
  of its last token, so prefill chunks end on block boundaries (see
  ``mamba_aligned_chunk``) and every full-block state can be registered in
  the prefix cache under the block's hash. The state of the previous chunk
  is kept until the next chunk has copied it forward, then freed (cached
  ones stay findable until evicted). A hit is the last cached state at or
  below the attention hit, found right to left.
- **none** mode (no prefix caching): slots behave like a one-token sliding
  window: blocks wholly before the last computed token are released.

Hashes of the Mamba group are the attention hashes plus a group tag, so a
block of either group never answers a lookup of the other.
"""

from __future__ import annotations

from llmsched.core.kv.block import KVBlock
from llmsched.core.kv.block_pool import BlockPool

_GROUP_TAG = b"\x00mamba"


def mamba_key(block_hash: bytes) -> bytes:
    """The prefix-cache key of a Mamba state block for ``block_hash``."""
    return block_hash + _GROUP_TAG


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class MambaGroup:
    """Block tables of the Mamba group, one per request, over a pool shared with attention."""

    __slots__ = (
        "_allocated",
        "_last_state",
        "_retired",
        "align",
        "block_size",
        "cached_this_step",
        "enable_caching",
        "num_cached",
        "pool",
        "tables",
    )

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.align = enable_caching
        self.tables: dict[str, list[KVBlock]] = {}
        # Slots registered in the prefix cache (align mode), by request.
        self.num_cached: dict[str, int] = {}
        # Requests that had a chunk allocated (not only a hit adopted).
        self._allocated: set[str] = set()
        # Slot of the state the running chunk starts from: freed once passed.
        self._last_state: dict[str, int] = {}
        # Slots below this were already released.
        self._retired: dict[str, int] = {}
        # State keys registered during this schedule() call: another request
        # cannot start from them before the step that computes them runs.
        self.cached_this_step: set[bytes] = set()

    # ---- lookups -----------------------------------------------------------

    def find_hit(self, hashes: list[bytes], max_length: int) -> tuple[list[KVBlock], int]:
        """The longest cached state at a block boundary within ``max_length`` tokens.

        Returns the table prefix (null blocks, then the state's block) and its
        length in tokens.
        """
        bs = self.block_size
        get = self.pool.get_cached_block
        for i in range(max_length // bs - 1, -1, -1):
            block = get(mamba_key(hashes[i]))
            if block is not None:
                return [self.pool.null_block] * i + [block], (i + 1) * bs
        return [], 0

    def blocks_needed(self, request_id: str, num_tokens: int, hit: list[KVBlock], total_computed: int) -> int:
        """Blocks an allocation up to ``num_tokens`` would take (hit blocks in the free queue count).

        A hit on a state registered earlier in this step returns more than
        the pool holds: it must wait for the next step.
        """
        pool = self.pool
        if hit and hit[-1].block_hash in self.cached_this_step:
            return pool.num_blocks + 1
        table = self.tables.get(request_id, ())
        bs = self.block_size
        if self.align:
            n = cdiv(num_tokens, bs) - len(hit) - len(table)
            if n > 0:
                n = 1
        else:
            required = cdiv(num_tokens, bs)
            skipped = (total_computed - 1) // bs
            n = max(required - max(skipped, len(hit) + len(table)), 0)
        null = pool.null_block
        return n + sum(1 for b in hit if b.ref_cnt == 0 and b is not null)

    # ---- allocation ----------------------------------------------------------

    def add_hit(self, request_id: str, hit: list[KVBlock]) -> None:
        """Adopt a prefix hit's table (first allocation only)."""
        null = self.pool.null_block
        self.pool.touch([b for b in hit if b is not null])
        self.tables[request_id] = list(hit)
        self.num_cached[request_id] = len(hit)

    def release_passed(self, request_id: str, processed: int) -> None:
        """Free the states no longer needed once ``processed`` tokens are computed for good."""
        table = self.tables.get(request_id)
        if table is None:
            return
        bs = self.block_size
        null = self.pool.null_block
        skipped = processed - 1
        if skipped > 0:
            last = min(skipped // bs, len(table))
            if self.align:
                first = self._retired.get(request_id, 0)
                if first < last:
                    freed = []
                    for i in range(last - 1, first - 1, -1):
                        if table[i] is not null:
                            freed.append(table[i])
                            table[i] = null
                    if freed:
                        self.pool.free_blocks(freed)
                    self._retired[request_id] = last
            else:
                freed = []
                for i in range(last - 1, -1, -1):
                    if table[i] is null:
                        break
                    freed.append(table[i])
                    table[i] = null
                if freed:
                    self.pool.free_blocks(freed)
        if self.align:
            idx = self._last_state.get(request_id)
            if idx is not None and idx < cdiv(processed, bs) - 1 and table[idx] is not null:
                self.pool.free_blocks([table[idx]])
                table[idx] = null

    def allocate(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        """Give the request a state slot for its position ``num_tokens``; returns the blocks added."""
        table = self.tables.setdefault(request_id, [])
        bs = self.block_size
        required = cdiv(num_tokens, bs)
        if not self.align:
            more = required - len(table)
            if more <= 0:
                return []
            new = self.pool.get_new_blocks(more)
            table.extend(new)
            return new
        if required <= len(table):
            self._allocated.add(request_id)
            return []
        prev = len(table)
        if prev > 0:
            # The state this chunk starts from: the previous chunk's, or the hit's.
            self._last_state[request_id] = prev - 1
        if prev < required - 1:
            table.extend([self.pool.null_block] * (required - 1 - prev))
        new = self.pool.get_new_blocks(required - len(table))
        table.extend(new)
        self._allocated.add(request_id)
        return new

    def cache(self, request_id: str, hashes: list[bytes], num_tokens: int) -> None:
        """Register the states at full-block boundaries among the first ``num_tokens`` tokens."""
        if not self.enable_caching:
            return
        start = self.num_cached.get(request_id, 0)
        num_full = min(num_tokens, len(hashes) * self.block_size) // self.block_size
        if num_full <= start:
            return
        table = self.tables[request_id]
        null = self.pool.null_block
        for i in range(start, num_full):
            block = table[i]
            if block is null:
                continue
            key = mamba_key(hashes[i])
            if block.block_hash is not None:
                self.pool.evict(block)
            self.pool.cache_block(block, key)
            self.cached_this_step.add(key)
        self.num_cached[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's states, tail first."""
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        self._allocated.discard(request_id)
        self._last_state.pop(request_id, None)
        self._retired.pop(request_id, None)
        if table:
            null = self.pool.null_block
            self.pool.free_blocks([b for b in reversed(table) if b is not null])

    def state_ids(self, request_id: str, start: int, end: int) -> tuple[int, int]:
        """(block id of the state at ``start`` or -1 at 0, block id the state at ``end`` goes to)."""
        table = self.tables[request_id]
        bs = self.block_size
        src = table[cdiv(start, bs) - 1].block_id if start else -1
        return src, table[cdiv(end, bs) - 1].block_id

    def held_blocks(self) -> list[list[KVBlock]]:
        """Every table's real blocks (for invariant checks)."""
        null = self.pool.null_block
        return [[b for b in t if b is not null] for t in self.tables.values()]


def mamba_aligned_chunk(
    request_num_prompt_tokens: int,
    request_num_tokens: int,
    start: int,
    num_new_tokens: int,
    block_size: int,
    max_prefill_tokens: int,
    junction: int,
) -> int:
    """Cut a prefill chunk so it ends where a Mamba state can be cached (align mode).

    A state is written at a chunk's end and cached only on a block boundary,
    so a prefill chunk that does not finish the prompt ends on one; the
    prompt's last chunk is exempt. A chunk never runs past the last boundary
    before the final token, nor past a junction (see HybridKVCacheManager),
    and one that starts mid-block stops at the next boundary. 0 means the
    aligned chunk does not fit: the request sits this step out.
    ``max_prefill_tokens``: the budget, capped by long_prefill_token_threshold.
    """
    prefill_end = max(request_num_prompt_tokens, request_num_tokens - 1)
    if start >= prefill_end:
        return num_new_tokens
    bs = block_size
    last_cache_position = (request_num_tokens - 1) // bs * bs
    end = start + num_new_tokens
    if end < prefill_end:
        aligned_end = end // bs * bs
        if aligned_end > start or bs <= max_prefill_tokens:
            end = aligned_end
    stop = end
    if start % bs:
        boundary = (start // bs + 1) * bs
        if start < boundary < stop:
            stop = boundary
    if start < last_cache_position < stop:
        stop = last_cache_position
    if start < junction < end:
        floored = start + (junction - start) // bs * bs
        if start < floored < stop:
            stop = floored
    return max(stop - start, 0)
