"""The encoder cache's bookkeeping: which encoder outputs exist, who uses them, what to evict.

Sizes count embeddings (one per placeholder position). An entry is keyed by
its item's content hash, so two requests with the same image share one
entry. An entry nobody references stays cached (a later request may hit it)
until room is needed, when the oldest unreferenced entries are evicted
first. No tensor lives here: executors keep the outputs and drop those this
cache reports evicted.
"""

from __future__ import annotations

from collections import OrderedDict

from llmsched.core.request import Request


class EncoderCache:
    """Encoder outputs by content hash, with per-request references and oldest-first eviction."""

    __slots__ = (
        "_evicted",
        "_item_refs",
        "_refs",
        "_sizes",
        "_unreferenced",
        "num_allocated",
        "num_free",
        "num_hits",
        "num_reclaimable",
        "size",
    )

    def __init__(self, size: int) -> None:
        self.size = size
        # Embedding slots held by no entry at all.
        self.num_free = size
        # Free slots plus those of unreferenced entries (evictable on demand).
        self.num_reclaimable = size
        # Content hash -> ids of the requests referencing it (empty: evictable).
        self._refs: dict[str, set[str]] = {}
        self._sizes: dict[str, int] = {}
        # Request id -> {item index: content hash} of the items it references.
        self._item_refs: dict[str, dict[int, str]] = {}
        # Unreferenced entries, oldest first (the eviction order).
        self._unreferenced: OrderedDict[str, int] = OrderedDict()
        self._evicted: list[str] = []
        # Cumulative, for metrics: lookups that found the output cached, outputs reserved.
        self.num_hits = 0
        self.num_allocated = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    @property
    def num_used(self) -> int:
        """Embedding slots held by cached entries, referenced or not."""
        return self.size - self.num_free

    def entry_size(self, mm_hash: str) -> int | None:
        """Embeddings of the cached entry, or None if it is not cached."""
        return self._sizes.get(mm_hash)

    def num_references(self, mm_hash: str) -> int:
        """How many requests reference the entry (0 for an evictable or absent one)."""
        return len(self._refs.get(mm_hash, ()))

    def referenced_items(self, request: Request) -> set[int]:
        """Indices of the request's items whose entries it references."""
        return set(self._item_refs.get(request.request_id, ()))

    def hit(self, request: Request, index: int) -> bool:
        """True if item ``index``'s output is cached; the request then references it."""
        mm_hash = request.mm_items[index].identifier
        users = self._refs.get(mm_hash)
        if users is None:
            return False
        if not users:
            self.num_reclaimable -= self._unreferenced.pop(mm_hash)
        users.add(request.request_id)
        self._note_item(request.request_id, index, mm_hash)
        self.num_hits += 1
        return True

    def can_allocate(self, request: Request, index: int, compute_budget: int, num_pending: int) -> bool:
        """Whether item ``index`` fits the compute budget and, with ``num_pending`` more, the cache.

        Makes the room by evicting unreferenced entries, oldest first, when
        the free slots alone are short; changes nothing when it answers False.
        """
        need = request.mm_items[index].length
        if need > compute_budget:
            return False
        need += num_pending
        if need <= self.num_free:
            return True
        if need > self.num_reclaimable:
            return False
        while need > self.num_free:
            mm_hash, n = self._unreferenced.popitem(last=False)
            del self._refs[mm_hash]
            del self._sizes[mm_hash]
            self._evicted.append(mm_hash)
            self.num_free += n
        return True

    def allocate(self, request: Request, index: int) -> None:
        """Reserve room for item ``index``'s output (after can_allocate said yes)."""
        item = request.mm_items[index]
        mm_hash = item.identifier
        self._refs.setdefault(mm_hash, set()).add(request.request_id)
        self._sizes.setdefault(mm_hash, item.length)
        self._note_item(request.request_id, index, mm_hash)
        self.num_free -= item.length
        self.num_reclaimable -= item.length
        self.num_allocated += 1

    def _note_item(self, request_id: str, index: int, mm_hash: str) -> None:
        self._item_refs.setdefault(request_id, {}).setdefault(index, mm_hash)

    def release_item(self, request: Request, index: int) -> None:
        """Drop the request's reference through item ``index``; the entry stays cached."""
        rid = request.request_id
        mm_hash = request.mm_items[index].identifier
        items = self._item_refs.get(rid)
        if items is not None and index in items:
            del items[index]
            if not items:
                del self._item_refs[rid]
        users = self._refs.get(mm_hash)
        if not users:
            return
        # The same image may fill several of its items: the reference stays
        # while any of them still holds it.
        if items and mm_hash in items.values():
            return
        users.discard(rid)
        if not users:
            n = self._sizes[mm_hash]
            self._unreferenced[mm_hash] = n
            self.num_reclaimable += n

    def release(self, request: Request) -> None:
        """Drop every reference the request holds (finish, abort, preemption)."""
        items = self._item_refs.get(request.request_id)
        if items:
            # A set's order, as vLLM walks it: it decides the eviction order.
            for index in list(set(items)):
                self.release_item(request, index)

    def take_evicted(self) -> list[str]:
        """Content hashes evicted since the last call (and not cached again since)."""
        evicted = [h for h in self._evicted if h not in self._refs]
        self._evicted = []
        return evicted

    def check_invariants(self) -> None:
        """Slot counts agree with the entries; raises AssertionError otherwise."""
        used = sum(self._sizes.values())
        assert self.num_free == self.size - used, (self.num_free, self.size, used)
        idle = sum(self._unreferenced.values())
        assert self.num_reclaimable == self.num_free + idle, (self.num_reclaimable, self.num_free, idle)
        for mm_hash, users in self._refs.items():
            assert bool(users) != (mm_hash in self._unreferenced), mm_hash
