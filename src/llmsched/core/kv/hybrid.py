"""The KV cache of a hybrid model: full attention and Mamba state groups on one block pool.

Attention keeps the ``KVCacheManager`` behaviour; the Mamba group
(``MambaGroup``) draws on the same pool. A prefix hit must hold in both
groups: the attention hit bounds the search for a cached state, and the hit
is cut back to that state's boundary. Where attention hit further than any
cached state, the difference marks a shared prefix whose state nobody cached
yet (the "junction"); the block-aligned split ends a chunk there so the
state gets cached for the requests that follow. Every allocation checks the
sum of both groups' needs before touching the pool, so a failure leaves no
trace; the order of touches and takes (hits of both groups, then new blocks
of both) follows vLLM's hybrid coordinator, which decides which cached blocks
get evicted.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmsched.core.kv.block import KVBlock
from llmsched.core.kv.mamba import MambaGroup
from llmsched.core.kv.manager import BlockTable, KVCacheManager, cdiv
from llmsched.core.request import Request

_NO_BLOCKS: list[KVBlock] = []


class HybridKVCacheManager(KVCacheManager):
    """Attention plus Mamba state blocks; same interface as ``KVCacheManager``."""

    is_hybrid = True
    # Each registration also caches the Mamba state at that hash, so
    # registrations stay eager.
    supports_lazy_registration = False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        super().__init__(num_blocks, block_size, max_model_len, enable_caching, hash_algo)
        self.mamba = MambaGroup(self.pool, block_size, enable_caching)
        # Per request: the Mamba part of its last prefix lookup, and the
        # junction that lookup found (0: none).
        self._mamba_hits: dict[str, list[KVBlock]] = {}
        self._junctions: dict[str, int] = {}

    @property
    def align(self) -> bool:
        """Whether prefill chunks must end on block boundaries (prefix caching on)."""
        return self.mamba.align

    def junction(self, request: Request) -> int:
        """Where the request's last lookup found attention cached further than any state (0: nowhere)."""
        return self._junctions.get(request.request_id, 0)

    def new_step(self) -> None:
        """A schedule() call starts: states registered before it may be hit now."""
        self.mamba.cached_this_step.clear()

    # ---- lookups -------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The hit both groups hold: attention blocks up to the last cached state at or below its hit."""
        rid = request.request_id
        attn, attn_len = super().get_computed_blocks(request)
        if not attn_len:
            self._mamba_hits.pop(rid, None)
            self._junctions[rid] = 0
            return _NO_BLOCKS, 0
        states, hit = self.mamba.find_hit(request.block_hashes, attn_len)
        self._mamba_hits[rid] = states
        self._junctions[rid] = attn_len if attn_len > hit else 0
        return attn[: hit // self.block_size], hit

    def blocks_to_admit(
        self,
        request: Request,
        hit_blocks: list[KVBlock],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        full_sequence: bool = False,
    ) -> int:
        """Free blocks an admission would consume, both groups together."""
        states = self._mamba_hits.get(request.request_id, _NO_BLOCKS) if hit_blocks else _NO_BLOCKS
        return self._admit_need(
            request, hit_blocks, states, num_new_tokens, num_lookahead_tokens, full_sequence
        )

    def _admit_need(
        self,
        request: Request,
        hit_blocks: list[KVBlock],
        states: list[KVBlock],
        num_new_tokens: int,
        num_lookahead_tokens: int,
        full_sequence: bool,
    ) -> int:
        attn = super().blocks_to_admit(
            request, hit_blocks, num_new_tokens, num_lookahead_tokens, full_sequence
        )
        hit = len(hit_blocks) * self.block_size
        if full_sequence:
            num_tokens = min(request.num_tokens, self.max_model_len)
        else:
            num_tokens = hit + num_new_tokens
        return attn + self.mamba.blocks_needed(request.request_id, num_tokens, states, hit)

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
        """First allocation of a waiting or preempted request, adopting its hit in both groups."""
        rid = request.request_id
        states = self._mamba_hits.get(rid, _NO_BLOCKS) if hit_blocks else _NO_BLOCKS
        free = self.pool.free_queue.num_free - reserved_blocks
        if full_sequence_must_fit and self._admit_need(request, hit_blocks, states, 0, 0, True) > free:
            return None
        need = self._admit_need(request, hit_blocks, states, num_new_tokens, num_lookahead_tokens, False)
        if need > free - held_for_others:
            return None
        self._mamba_hits.pop(rid, None)
        if hit_blocks:
            # Both groups' hits are taken before any new block, so a new
            # block can never be a hit block of the other group.
            self.pool.touch(hit_blocks)
            self.mamba.add_hit(rid, states)
        main = len(hit_blocks) * self.block_size + num_new_tokens
        table = self._new_table(rid, hit_blocks, main + num_lookahead_tokens)
        self.mamba.allocate(rid, main)
        if self.enable_caching and not delay_caching:
            self._cache_both(request, table, min(main, request.num_tokens))
        return table.blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[KVBlock] | None:
        """Extend a running request's tables; returns the attention blocks added, or None."""
        return self._extend(request, num_new_tokens, num_lookahead_tokens, full_sequence_must_fit=False)

    def allocate_held(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
    ) -> list[KVBlock] | None:
        """Admit a waiting request that holds blocks (a session resuming); its whole attention table."""
        added = self._extend(
            request, num_new_tokens, num_lookahead_tokens, full_sequence_must_fit, reserved_blocks
        )
        return None if added is None else self._tables[request.request_id].blocks

    def _extend(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        full_sequence_must_fit: bool,
        reserved_blocks: int = 0,
    ) -> list[KVBlock] | None:
        rid = request.request_id
        table = self._tables[rid]
        blocks = table.blocks
        bs = self.block_size
        computed = min(request.num_computed_tokens, self.max_model_len)
        free = self.pool.free_queue.num_free - reserved_blocks
        mamba = self.mamba
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            need = max(cdiv(full, bs) - len(blocks), 0) + mamba.blocks_needed(rid, full, _NO_BLOCKS, computed)
            if need > free:
                return None
        main = computed + num_new_tokens
        num_slots = min(main + num_lookahead_tokens, self.max_model_len)
        # Passed states go back to the pool first, whether or not this fits.
        mamba.release_passed(rid, max(0, computed - request.num_in_flight_tokens))
        free = self.pool.free_queue.num_free - reserved_blocks
        more = cdiv(num_slots, bs) - len(blocks)
        if max(more, 0) + mamba.blocks_needed(rid, main, _NO_BLOCKS, computed) > free:
            return None
        new_blocks = self.pool.get_new_blocks(more) if more > 0 else _NO_BLOCKS
        if more > 0:
            blocks.extend(new_blocks)
        mamba.allocate(rid, main)
        if self.enable_caching:
            self._cache_both(request, table, min(main, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register both groups' full blocks among the first ``num_tokens`` tokens."""
        table = self._tables.get(request.request_id)
        if self.enable_caching and table is not None:
            self._cache_both(request, table, num_tokens)

    def _cache_both(self, request: Request, table: BlockTable, num_tokens: int) -> None:
        if num_tokens // self.block_size > table.num_cached:
            self._cache_full_blocks(request, table, num_tokens)
        hashes = self.hasher.extend(request, num_tokens // self.block_size)
        self.mamba.cache(request.request_id, hashes, num_tokens)

    def free(self, request: Request) -> None:
        """Release both groups' blocks (attention first, each tail first)."""
        super().free(request)
        self.mamba.free(request.request_id)
        self._mamba_hits.pop(request.request_id, None)
        self._junctions.pop(request.request_id, None)

    def check_invariants(self, detached: Iterable[list[KVBlock]] = ()) -> None:
        """Reference counts over both groups' tables."""
        super().check_invariants((*detached, *self.mamba.held_blocks()))
