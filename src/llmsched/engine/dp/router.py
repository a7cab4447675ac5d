"""The front end's router: each new request goes to the least-loaded rank."""

from __future__ import annotations

# A queued request weighs more than a running one: it still owes its whole
# prefill, and it will take a slot that a running request already holds.
WAITING_WEIGHT = 4


class LeastLoadedRouter:
    """Scores each rank ``WAITING_WEIGHT * waiting + running`` and picks the lowest.

    Counts come from the ranks' reports; requests sent since a rank's last
    report count as waiting there, so a burst of arrivals between two
    reports still spreads. Ties go to the next rank in rotation.
    """

    __slots__ = ("_next", "_received", "_running", "_sent", "_waiting", "num_ranks")

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        self.num_ranks = num_ranks
        self._running = [0] * num_ranks
        self._waiting = [0] * num_ranks
        self._sent = [0] * num_ranks
        self._received = [0] * num_ranks
        self._next = 0

    def load(self, rank: int) -> int:
        """The rank's score: lower is less loaded."""
        in_flight = self._sent[rank] - self._received[rank]
        return WAITING_WEIGHT * (self._waiting[rank] + in_flight) + self._running[rank]

    def choose(self) -> int:
        """The rank the next request should go to (does not record it; see ``routed``)."""
        n = self.num_ranks
        start = self._next
        best = start
        best_load = self.load(start)
        for i in range(1, n):
            r = (start + i) % n
            load = self.load(r)
            if load < best_load:
                best, best_load = r, load
        return best

    def routed(self, rank: int) -> None:
        """Record that a request was sent to ``rank``; ties rotate past it."""
        self._sent[rank] += 1
        self._next = (rank + 1) % self.num_ranks

    def update(self, rank: int, running: int, waiting: int, received: int) -> None:
        """A rank's report: its queue sizes once it had received ``received`` requests."""
        self._running[rank] = running
        self._waiting[rank] = waiting
        self._received[rank] = received

    def loads(self) -> list[int]:
        """Every rank's score, in rank order."""
        return [self.load(r) for r in range(self.num_ranks)]
