"""Per-tenant fair share by a virtual token counter (VTC, Sheng et al., OSDI'24)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from llmsched.core.policies.base import BasePolicy, remaining_tokens
from llmsched.core.policy_seam import Refusal, Verdict, WaitingQueue
from llmsched.core.request import Request
from llmsched.core.trace import Reason

DEFAULT_TENANT = ""


def tenant_of(req: Request) -> str:
    """The request's tenant ('' when none was given)."""
    t = req.tenant
    return DEFAULT_TENANT if t is None else t


class FairQueue:
    """One FIFO per tenant; the tenant with the smallest counter goes next.

    A tenant that becomes backlogged again has its counter lifted to the
    smallest counter among backlogged tenants, so idle time banks no credit.
    """

    __slots__ = ("_counters", "_head", "_len", "_q")

    def __init__(self, counters: dict[str, float]) -> None:
        self._counters = counters
        self._q: dict[str, deque[Request]] = {}
        self._len = 0
        # What peek() returned: pop() removes exactly that request, even if
        # the counters moved in between (admission charges them).
        self._head: Request | None = None

    def _tenant_queue(self, t: str) -> deque[Request]:
        q = self._q.get(t)
        if q is None:
            counters = self._counters
            others = [counters.get(u, 0.0) for u in self._q]
            if others:
                counters[t] = max(counters.get(t, 0.0), min(others))
            q = self._q[t] = deque()
        return q

    def add(self, request: Request) -> None:
        """Append to its tenant's FIFO."""
        self._tenant_queue(tenant_of(request)).append(request)
        self._len += 1

    def add_preempted(self, request: Request) -> None:
        """Put at the front of its tenant's FIFO."""
        self._tenant_queue(tenant_of(request)).appendleft(request)
        self._len += 1

    def requeue(self, requests: list[Request]) -> None:
        """Put back at the front of their tenants' FIFOs, in their order."""
        for r in reversed(requests):
            self.add_preempted(r)

    def _next_tenant(self) -> str:
        counters = self._counters
        best = ""
        best_key: tuple[float, float] | None = None
        for t, q in self._q.items():
            key = (counters.get(t, 0.0), q[0].arrival_time)
            if best_key is None or key < best_key:
                best, best_key = t, key
        return best

    def peek(self) -> Request:
        """The head of the least-served backlogged tenant."""
        if not self._len:
            raise IndexError("peek from an empty queue")
        head = self._head = self._q[self._next_tenant()][0]
        return head

    def pop(self) -> Request:
        """Remove the head of the least-served backlogged tenant."""
        if not self._len:
            raise IndexError("pop from an empty queue")
        head, self._head = self._head, None
        t = tenant_of(head) if head is not None else self._next_tenant()
        q = self._q.get(t)
        if head is None or q is None or head not in q:
            t = self._next_tenant()
            q = self._q[t]
            req = q.popleft()
        elif q[0] is head:
            req = q.popleft()
        else:
            q.remove(head)
            req = head
        if not q:
            del self._q[t]
        self._len -= 1
        return req

    def remove(self, requests: set[Request]) -> None:
        """Drop requests, keeping the others' order."""
        self._head = None
        for t in list(self._q):
            q = deque(r for r in self._q[t] if r not in requests)
            self._len -= len(self._q[t]) - len(q)
            if q:
                self._q[t] = q
            else:
                del self._q[t]

    def min_backlogged(self) -> float | None:
        """The smallest counter among tenants with requests here."""
        counters = self._counters
        return min((counters.get(t, 0.0) for t in self._q), default=None)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        counters = self._counters
        for t in sorted(self._q, key=lambda t: (counters.get(t, 0.0), self._q[t][0].arrival_time)):
            yield from self._q[t]


class FairPolicy(BasePolicy):
    """Virtual token counter per tenant: admit from the tenant served least.

    A tenant's counter grows by ``input_weight`` per prompt token and
    ``output_weight`` per expected output token (max_tokens capped at
    ``output_cap``) of each request admitted, charged at admission. With
    ``max_lead_tokens`` > 0, a request whose tenant's counter leads the
    least-served backlogged tenant by more than that is held (which happens
    when skip-admission passed over that tenant's request).
    """

    name = "fair"
    KNOBS = {"input_weight": 1.0, "output_weight": 2.0, "output_cap": 4096, "max_lead_tokens": 16384}

    def __init__(self, config: dict | None = None, skip: bool = False) -> None:
        super().__init__(config, skip)
        self.counters: dict[str, float] = {}
        self._queues: list[FairQueue] = []
        self._charged: tuple[Request, float] | None = None

    def make_queue(self) -> WaitingQueue:
        """Per-tenant FIFOs sharing this policy's counters."""
        q = FairQueue(self.counters)
        self._queues.append(q)
        return q

    def _cost(self, req: Request) -> float:
        k = self.knobs
        prompt_left = max(req.num_tokens - req.num_computed_tokens, 0)
        output_left = remaining_tokens(req, k["output_cap"]) - prompt_left
        return k["input_weight"] * prompt_left + k["output_weight"] * output_left

    def admit(self, request: Request, blocked: tuple[Reason, str] | None) -> Refusal | None:
        """Hold a tenant far ahead of the least served; charge the admission (undone if it does not fit)."""
        t = tenant_of(request)
        counters = self.counters
        if blocked is not None:
            charged = self._charged
            if charged is not None and charged[0] is request:
                counters[t] -= charged[1]
                self._charged = None
            return self.skip_refusal(request, blocked)
        mine = counters.get(t, 0.0)
        lead = self.knobs["max_lead_tokens"]
        if lead:
            least = min((m for q in self._queues if (m := q.min_backlogged()) is not None), default=None)
            if least is not None and mine - least > lead:
                return (
                    Verdict.STOP,
                    Reason.FAIR_SHARE_HOLD,
                    f"tenant {t!r} leads by {mine - least:.0f} tokens",
                )
        cost = self._cost(request)
        counters[t] = mine + cost
        self._charged = (request, cost)
        return None

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """From the most-served tenant, its latest admitted request; none for a waiting one."""
        if for_request is not None:
            return None
        counters = self.counters
        best = running[-1]
        top = counters.get(tenant_of(best), 0.0)
        for r in reversed(running):
            c = counters.get(tenant_of(r), 0.0)
            if c > top:
                best, top = r, c
        return best
