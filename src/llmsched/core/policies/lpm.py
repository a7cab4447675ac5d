"""Longest prefix-cache match first (as SGLang's ``lpm``), with aging."""

from __future__ import annotations

from collections.abc import Iterator

from llmsched.core.policies.base import BasePolicy
from llmsched.core.policy_seam import WaitingQueue
from llmsched.core.request import Request


class LPMQueue:
    """Arrival order, re-ranked once per step by prefix-cache hit.

    The first ``max_scan`` waiting requests are ranked by ``aging *
    arrival - hit_tokens`` (longest hit first, older first on a tie; aging
    bounds how long a request without a hit can be passed over); those
    beyond keep arrival order after them, so a deep queue costs a bounded
    number of cache lookups per step.
    """

    __slots__ = ("_head", "_items", "_order", "_order_step", "_policy")

    def __init__(self, policy: LPMPolicy) -> None:
        self._policy = policy
        self._items: list[Request] = []
        self._order: list[Request] | None = None
        self._order_step = -1
        # What peek() returned: pop() removes exactly that request.
        self._head: Request | None = None

    def add(self, request: Request) -> None:
        """Append (ranked at the next look)."""
        self._items.append(request)
        self._order = None

    def add_preempted(self, request: Request) -> None:
        """Put at the front of the arrival order."""
        self._items.insert(0, request)
        self._order = None

    def requeue(self, requests: list[Request]) -> None:
        """Put back at the front, in their order (ranked at the next look)."""
        self._items[:0] = requests
        self._order = None

    def _ranked(self) -> list[Request]:
        p = self._policy
        step = p.sched.next_step if p.sched is not None else 0
        order = self._order
        if order is None or step != self._order_step:
            items = self._items
            scan = int(p.knobs["max_scan"])
            head = items[:scan]
            aging = p.knobs["aging_tokens_per_s"]
            hit = p.hit_tokens
            keyed = sorted(((aging * r.arrival_time - hit(r), k) for k, r in enumerate(head)))
            order = [head[k] for _, k in keyed]
            order.extend(items[scan:])
            order.reverse()  # popped from the end
            self._order, self._order_step = order, step
        return order

    def peek(self) -> Request:
        """The best-ranked request."""
        if not self._items:
            raise IndexError("peek from an empty queue")
        head = self._head = self._ranked()[-1]
        return head

    def pop(self) -> Request:
        """Remove the best-ranked request."""
        if not self._items:
            raise IndexError("pop from an empty queue")
        order = self._ranked()
        head, self._head = self._head, None
        if head is None or head is order[-1]:
            req = order.pop()
        elif head in self._items:
            order.remove(head)
            req = head
        else:
            req = order.pop()
        self._items.remove(req)
        return req

    def remove(self, requests: set[Request]) -> None:
        """Drop requests."""
        self._items = [r for r in self._items if r not in requests]
        self._order = None
        self._head = None

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return reversed(self._ranked()) if self._items else iter(())


class LPMPolicy(BasePolicy):
    """Admit the waiting request with the longest prefix-cache hit first.

    Requests sharing a prefix with what is cached (or just admitted) run
    while their prefix is still there, instead of after it was evicted.
    """

    name = "lpm"
    KNOBS = {"max_scan": 128, "aging_tokens_per_s": 100.0}

    def hit_tokens(self, req: Request) -> int:
        """Tokens of ``req``'s prompt found in the prefix cache now."""
        sched = self.sched
        if sched is None or req.num_computed_tokens:
            return 0
        return sched.kv.get_computed_blocks(req)[1]

    def make_queue(self) -> WaitingQueue:
        """Arrival order re-ranked by prefix hit."""
        return LPMQueue(self)
