"""What the policies beyond FCFS and priority share: knobs, a keyed queue, the skip rule."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from llmsched.core.errors import ConfigError
from llmsched.core.policy_seam import (
    FCFSQueue,
    PriorityQueue,
    Refusal,
    SchedulerView,
    Verdict,
    WaitingQueue,
    _priority_key,
)
from llmsched.core.request import Request
from llmsched.core.trace import Reason

# Reasons a request does not fit that skipping past it can help with: the
# next request may be smaller. (A full batch or a cadence hold stops everyone.)
SKIPPABLE = frozenset({Reason.KV_SHORT, Reason.WATERMARK, Reason.NO_CHUNKING})

SKIP_KNOBS: dict[str, Any] = {
    # A request skipped this many times is skipped no more: admissions then
    # wait for it (a reservation), so skipping cannot starve it.
    "skip_limit": 64,
    # At most this many skips per step, so a deep queue costs a bounded scan.
    "max_skips_per_step": 32,
}


def remaining_tokens(req: Request, output_cap: int) -> int:
    """Tokens still to compute: the prompt (or recompute) left plus the output left, capped."""
    out_left = req.max_tokens - (req.num_tokens - req.num_prompt_tokens)
    return req.num_tokens - req.num_computed_tokens + max(min(out_left, output_cap), 0)


class KeyedQueue:
    """Smallest key first; the key is computed when a request is queued.

    Ties fall to the order requests were queued, so the order is total.
    """

    __slots__ = ("_heap", "_key", "_seq")

    def __init__(self, key: Callable[[Request], float]) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._key = key
        self._seq = 0

    def add(self, request: Request) -> None:
        """Insert by key."""
        self._seq += 1
        heapq.heappush(self._heap, (self._key(request), self._seq, request))

    add_preempted = add

    def requeue(self, requests: list[Request]) -> None:
        """Insert each by key."""
        for r in requests:
            self.add(r)

    def peek(self) -> Request:
        """The smallest key."""
        return self._heap[0][2]

    def pop(self) -> Request:
        """Remove the smallest key."""
        return heapq.heappop(self._heap)[2]

    def remove(self, requests: set[Request]) -> None:
        """Drop requests and restore the heap."""
        self._heap = [e for e in self._heap if e[2] not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._heap, key=lambda e: (e[0], e[1])))


class BasePolicy:
    """A policy that decides admission: FCFS order, the skip rule when enabled.

    Subclasses override ``make_queue``, ``admit`` or ``select_victim`` and
    declare their knobs in ``KNOBS`` (name: default); ``config`` overrides them.
    """

    name = "fcfs"
    decides_admission = True
    KNOBS: dict[str, Any] = {}

    def __init__(self, config: dict | None = None, skip: bool = False) -> None:
        knobs = {**self.KNOBS, **(SKIP_KNOBS if skip else {})}
        config = dict(config or {})
        unknown = sorted(set(config) - set(knobs))
        if unknown:
            raise ConfigError(
                f"policy {self.name!r}: unknown policy_config keys {unknown}; known: {sorted(knobs)}"
            )
        self.knobs = {**knobs, **config}
        for k, default in knobs.items():
            v = self.knobs[k]
            numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
            if numeric and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ConfigError(f"policy {self.name!r}: {k}={v!r} must be a number >= 0")
        self.skip = skip
        if skip:
            self.name = f"{self.name}+skip-admission"
        self.sched: SchedulerView | None = None
        self._skips: dict[str, int] = {}
        self._skip_step = -1
        self._skips_this_step = 0

    def bind(self, scheduler: SchedulerView) -> None:
        """Remember the scheduler (its clock, its prefix cache, its live requests)."""
        self.sched = scheduler

    def make_queue(self) -> WaitingQueue:
        """Arrival order."""
        return FCFSQueue()

    def admit(self, request: Request, blocked: tuple[Reason, str] | None) -> Refusal | None:
        """Try every request; when one does not fit, the skip rule (if on) decides."""
        return None if blocked is None else self.skip_refusal(request, blocked)

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """The most recently admitted running request; none for a waiting one."""
        return running[-1] if for_request is None else None

    def skip_refusal(self, request: Request, blocked: tuple[Reason, str]) -> Refusal | None:
        """SKIP a request that does not fit, within the per-request and per-step limits."""
        if not self.skip or blocked[0] not in SKIPPABLE:
            return None
        sched = self.sched
        step = sched.next_step if sched is not None else 0
        if step != self._skip_step:
            self._skip_step, self._skips_this_step = step, 0
        if self._skips_this_step >= self.knobs["max_skips_per_step"]:
            return None
        rid = request.request_id
        n = self._skips.get(rid, 0)
        if n >= self.knobs["skip_limit"]:
            return None
        if len(self._skips) > 4096 and sched is not None:
            # Forget requests that have finished.
            self._skips = {k: v for k, v in self._skips.items() if k in sched.requests}
        self._skips[rid] = n + 1
        self._skips_this_step += 1
        return (
            Verdict.SKIP,
            Reason.SKIPPED_NO_ROOM,
            f"{blocked[1]}; skip {n + 1} of {self.knobs['skip_limit']}",
        )


class PriorityOrderPolicy(BasePolicy):
    """vLLM's priority order with the skip rule on top (``priority+skip-admission``)."""

    name = "priority"

    def make_queue(self) -> WaitingQueue:
        """A heap keyed by (priority, arrival_time, request_id)."""
        return PriorityQueue()

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """The lowest-ranked running request; none for a waiting one."""
        return max(running, key=_priority_key) if for_request is None else None
