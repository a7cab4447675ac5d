"""Encoder inputs (images) on requests, and the step's encoder budget.

An item's embeddings fill prompt positions ``[offset, offset + length)``.
It is encoded in the step whose token range first overlaps it, unless its
output is cached already (by content hash, from any request) or another
request of the same step encodes it; the whole item must fit the step's
encoder compute budget and the encoder cache. When it does not, the chunk
stops just before it. Once a request's computed tokens pass an item, its
reference to the output is dropped (the output stays cached, evictable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmsched.core.encoder_cache import EncoderCache
from llmsched.core.errors import RequestRejected
from llmsched.core.mm_item import MMItem
from llmsched.core.request import Request


def check_items(request_id: str, items: Sequence[MMItem], num_prompt_tokens: int) -> None:
    """Raise RequestRejected unless the items are sorted, disjoint, non-empty and inside the prompt."""
    prev_end = 0
    for k, it in enumerate(items):
        if it.length < 1 or it.offset < 0:
            raise RequestRejected(
                f"request {request_id!r}: encoder input #{k} has offset {it.offset}, length {it.length}"
            )
        if it.offset < prev_end:
            raise RequestRejected(
                f"request {request_id!r}: encoder input #{k} starts at {it.offset}, inside or before "
                f"the previous one (ending at {prev_end}); items must be sorted and disjoint"
            )
        if it.end > num_prompt_tokens:
            raise RequestRejected(
                f"request {request_id!r}: encoder input #{k} ends at {it.end}, past the "
                f"{num_prompt_tokens}-token prompt"
            )
        prev_end = it.end


@dataclass(slots=True)
class EncoderPlan:
    """What admitting a request's chunk would encode: new items, items another one of its items encodes."""

    to_encode: list[int]
    duplicates: list[int]
    budget_left: int


class EncoderScheduler:
    """The scheduler's encoder side: the per-step compute budget and the encoder cache."""

    __slots__ = (
        "budget",
        "budget_per_step",
        "cache",
        "chunked_items",
        "max_chunk",
        "mismatched",
        "scheduled",
    )

    def __init__(
        self, budget_per_step: int, cache_size: int, chunked_items: bool = True, max_chunk: int | None = None
    ) -> None:
        self.budget_per_step = budget_per_step
        # The token budget: with chunked_items off, an item must fit in one chunk.
        self.max_chunk = max_chunk
        self.budget = budget_per_step
        self.cache = EncoderCache(cache_size)
        # False: a chunk may not cover only part of an item.
        self.chunked_items = chunked_items
        # This step's items to encode: request id -> item indices.
        self.scheduled: dict[str, list[int]] = {}
        # Requests whose item's content hash names an output of another
        # size (a reused id): they fail at the next update, as in vLLM.
        self.mismatched: set[str] = set()

    def check_request(self, request: Request) -> None:
        """Raise RequestRejected for a request whose items could never be encoded."""
        check_items(request.request_id, request.mm_items, request.num_prompt_tokens)
        limit = min(self.budget_per_step, self.cache.size)
        for k, it in enumerate(request.mm_items):
            if it.length > limit:
                raise RequestRejected(
                    f"request {request.request_id!r}: encoder input #{k} has {it.length} embeddings, more "
                    f"than the encoder budget ({self.budget_per_step}) or cache ({self.cache.size}) holds"
                )
            if not self.chunked_items and self.max_chunk is not None and it.length > self.max_chunk:
                raise RequestRejected(
                    f"request {request.request_id!r}: encoder input #{k} has {it.length} placeholder tokens, "
                    f"more than max_num_batched_tokens ({self.max_chunk}), and disable_chunked_mm_input "
                    "forbids splitting it: it could never be scheduled"
                )

    def begin_step(self) -> None:
        """Start a step: a fresh compute budget and no items scheduled."""
        self.budget = self.budget_per_step
        self.scheduled = {}

    def try_schedule(self, req: Request, computed: int, n: int) -> tuple[int, EncoderPlan | None, str]:
        """Cut ``n`` tokens after ``computed`` so every overlapped item is cached or encodable.

        Returns the tokens left, the plan to commit if the chunk is taken,
        and why an item held the chunk back ('' when none did). Cache hits
        take a reference at once, and making room may evict, whether or not
        the chunk is taken in the end (as vLLM does).
        """
        items = req.mm_items
        end = computed + n
        if n <= 0 or items[-1].end <= computed:
            return n, None, ""
        cache = self.cache
        budget = self.budget
        to_encode: list[int] = []
        duplicates: list[int] = []
        pending: dict[str, int] = {}
        num_pending = 0
        held = ""
        for i, it in enumerate(items):
            if it.end <= computed:
                continue
            if it.offset >= end:
                break
            if not self.chunked_items and computed <= it.offset and end < it.end:
                n = max(0, it.offset - computed)
                held = f"{it.modality} #{i} would be split (chunked mm input disabled)"
                break
            known = pending.get(it.identifier)
            if known is None:
                known = cache.entry_size(it.identifier)
                pending_dup = False
            else:
                pending_dup = True
            if known is not None and known != it.length:
                self.mismatched.add(req.request_id)
                return (
                    0,
                    None,
                    f"{it.modality} #{i}: id {it.identifier!r} holds {known} embeddings, not {it.length}",
                )
            if pending_dup:
                duplicates.append(i)
                continue
            if cache.hit(req, i):
                continue
            if not cache.can_allocate(req, i, budget, num_pending):
                short = "encoder budget" if it.length > budget else "encoder cache"
                held = f"{it.modality} #{i} ({it.length} embeddings) does not fit the {short}"
                n = min(n, it.offset - computed) if computed < it.offset else 0
                break
            num_pending += it.length
            budget -= it.length
            pending[it.identifier] = it.length
            to_encode.append(i)
        return n, EncoderPlan(to_encode, duplicates, budget), held

    def commit(self, req: Request, plan: EncoderPlan | None) -> None:
        """The chunk was taken: charge the budget and reserve the cache for its items."""
        if plan is None:
            return
        cache = self.cache
        if plan.to_encode:
            self.scheduled[req.request_id] = plan.to_encode
            self.budget = plan.budget_left
            for i in plan.to_encode:
                cache.allocate(req, i)
        for i in plan.duplicates:
            cache.hit(req, i)

    def unschedule(self, req: Request) -> None:
        """A request scheduled earlier this step was taken back: its items' budget returns."""
        items = self.scheduled.pop(req.request_id, None)
        if items:
            self.budget += sum(req.mm_items[i].length for i in items)

    def release_passed(self, req: Request) -> None:
        """Drop the references to items the request's confirmed progress has passed."""
        cache = self.cache
        refs = cache.referenced_items(req)
        if not refs:
            return
        done = req.num_computed_tokens - req.num_output_placeholders
        items = req.mm_items
        for i in refs:
            if items[i].end <= done:
                cache.release_item(req, i)

    def release(self, req: Request) -> None:
        """Drop all the request's references (finish, abort, preemption, failed admission)."""
        self.cache.release(req)

    def take_evicted(self) -> list[str]:
        """Content hashes evicted this step."""
        return self.cache.take_evicted()
