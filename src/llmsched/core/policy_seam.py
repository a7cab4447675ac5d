"""The scheduling-policy seam's types: waiting queues, verdicts, the Policy protocol, FCFS and priority.

A policy is deliberately small (see ``Policy``): it makes the waiting queue
(which decides admission order), may refuse or skip past the request about
to be admitted, and picks a victim when KV blocks run out. Everything else
(budgets, KV) stays in the scheduler. FCFS and priority live here and are
vLLM-exact; the others are in ``llmsched.core.policies``.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from llmsched.core.kv.manager import KVCacheManager
from llmsched.core.request import Request
from llmsched.core.trace import Reason


class WaitingQueue(Protocol):
    """Requests waiting for admission, in the order the policy admits them."""

    def add(self, request: Request) -> None:
        """Enqueue a newly arrived request."""

    def add_preempted(self, request: Request) -> None:
        """Enqueue a request that was just preempted."""

    def requeue(self, requests: list[Request]) -> None:
        """Put back requests popped and set aside this step, in their original order."""

    def peek(self) -> Request:
        """The next request to admit."""

    def pop(self) -> Request:
        """Remove and return the next request to admit."""

    def remove(self, requests: set[Request]) -> None:
        """Drop the given requests (aborts)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; preempted requests go back to the very front."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """Append at the back."""
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        """Put at the front: it was admitted before everything still waiting."""
        self._q.appendleft(request)

    def requeue(self, requests: list[Request]) -> None:
        """Put back at the front, keeping their order."""
        self._q.extendleft(reversed(requests))

    def peek(self) -> Request:
        """The head."""
        return self._q[0]

    def pop(self) -> Request:
        """Remove the head."""
        return self._q.popleft()

    def remove(self, requests: set[Request]) -> None:
        """Drop requests, keeping the others' order."""
        if len(requests) == 1:
            self._q.remove(next(iter(requests)))
        else:
            self._q = deque(r for r in self._q if r not in requests)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


def _priority_key(request: Request) -> tuple[int, float, str]:
    return (request.priority, request.arrival_time, request.request_id)


class PriorityQueue:
    """Lowest (priority, arrival_time, request_id) first; a total order, so
    the admission order never depends on the heap's internal layout."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add(self, request: Request) -> None:
        """Insert by key."""
        heapq.heappush(self._heap, (*_priority_key(request), request))

    add_preempted = add

    def requeue(self, requests: list[Request]) -> None:
        """Insert each by key (order is implied by the key)."""
        for r in requests:
            self.add(r)

    def peek(self) -> Request:
        """The smallest key."""
        return self._heap[0][3]

    def pop(self) -> Request:
        """Remove the smallest key."""
        return heapq.heappop(self._heap)[3]

    def remove(self, requests: set[Request]) -> None:
        """Drop requests and restore the heap."""
        self._heap = [e for e in self._heap if e[3] not in requests]
        heapq.heapify(self._heap)

    def rekey(self, request: Request) -> None:
        """The request's key changed while queued: update it where it sits, without sifting.

        vLLM's heap holds live requests, so a key changed in place (a session's
        arrival time when it resumes) takes effect at the next comparison but
        moves nothing until then; this mirrors that exactly.
        """
        heap = self._heap
        for i, e in enumerate(heap):
            if e[3] is request:
                heap[i] = (*_priority_key(request), request)
                return

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


class Verdict(enum.IntEnum):
    """What admission does with the request at the head of the waiting queue."""

    # Set it aside this step; the requests behind it may still be admitted.
    SKIP = 1
    # Admit nothing more this step.
    STOP = 2
    # Finish it without running: it cannot be served in time.
    DECLINE = 3


# A decision against admitting: the verdict, the trace reason and its detail.
Refusal = tuple[Verdict, Reason, str]


class Policy(Protocol):
    """The three decisions a scheduling policy makes; everything else (token
    budget, KV blocks, chunking, the running requests' order) stays in the
    scheduler.

    1. ``make_queue``: the waiting queue, whose order is the admission order.
    2. ``admit``: consulted only when ``decides_admission`` is true, for each
       request about to be admitted (``blocked`` None: return None to try it,
       or a Refusal), and again when it did not fit (``blocked`` is the
       scheduler's reason and detail: return None to stop admissions there,
       as vLLM does, or a Refusal such as SKIP).
    3. ``select_victim``: the running request to preempt. ``for_request`` is
       None when a running request needs KV blocks (a victim must be
       returned); with ``decides_admission`` it is also called for a waiting
       request that did not fit, with the running requests not admitted this
       step, and may return None to preempt nothing.

    An optional ``bind(scheduler)`` is called once, when the scheduler is
    built, for policies that read its clock or its prefix cache (what they
    may read is ``SchedulerView``).
    """

    name: str
    decides_admission: bool

    def make_queue(self) -> WaitingQueue:
        """A new, empty waiting queue."""

    def admit(self, request: Request, blocked: tuple[Reason, str] | None) -> Refusal | None:
        """None to go ahead (or, when ``blocked``, to stop there); else why not."""

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """The running request to preempt."""


class SchedulerView(Protocol):
    """What a policy bound to the scheduler may read of it."""

    @property
    def next_step(self) -> int:
        """The number the next scheduled step will carry."""

    @property
    def requests(self) -> Mapping[str, Request]:
        """The live requests by id."""

    @property
    def kv(self) -> KVCacheManager:
        """The KV cache manager (for prefix-cache lookups)."""

    @property
    def clock(self) -> Callable[[], float]:
        """The scheduler's clock, in seconds."""


class FCFSPolicy:
    """First come, first served: preempt the most recently admitted request."""

    name = "fcfs"
    decides_admission = False

    def make_queue(self) -> WaitingQueue:
        """A deque."""
        return FCFSQueue()

    def admit(self, request: Request, blocked: tuple[Reason, str] | None) -> Refusal | None:
        """vLLM's rule: try every request, stop at the first that does not fit."""
        return None

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """The last of the running list (never one for a waiting request)."""
        return running[-1] if for_request is None else None


class PriorityPolicy:
    """Smaller priority value first, then earlier arrival.

    The victim is the running request with the largest (priority,
    arrival_time, request_id): the same total order the waiting queue uses.
    vLLM leaves ties in (priority, arrival_time) to running order, which
    picks the longest-running of the tied requests: with equal arrival times
    two requests can then preempt themselves in turn forever. Arrival times
    from clocks (and from replay) never tie, so decisions are unchanged.
    """

    name = "priority"
    decides_admission = False

    def make_queue(self) -> WaitingQueue:
        """A heap keyed by (priority, arrival_time, request_id)."""
        return PriorityQueue()

    def admit(self, request: Request, blocked: tuple[Reason, str] | None) -> Refusal | None:
        """vLLM's rule: try every request, stop at the first that does not fit."""
        return None

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """The lowest-ranked running request (never one for a waiting request)."""
        return max(running, key=_priority_key) if for_request is None else None


POLICIES: dict[str, type] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}
