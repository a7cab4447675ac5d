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


# vLLM's coordinator publishes the ranks' queue sizes to the API servers at
# most this often while they change.
SNAPSHOT_INTERVAL_S = 0.1


class ApiServerRouter:
    """One API server's routing, as vLLM 0.33's data-parallel client does it.

    It sees the ranks only through the coordinator's latest snapshot
    (waiting, running, KV usage per rank, replaced wholesale when a new one
    comes, so it can be up to ``SNAPSHOT_INTERVAL_S`` old) and through its
    own requests still unfinished on each rank (exact: it sent them and
    reads their outputs). A rank's score is the larger of the snapshot's
    waiting + running and ``server_count`` x its own unfinished requests
    there (what all servers together probably sent), plus a penalty for a
    queue on a rank whose KV cache is over half full; the lowest wins, the
    scan starting one rank further each time so that ties rotate. The chosen
    rank's snapshot waiting count grows by ``server_count`` until the next
    snapshot replaces it.
    """

    __slots__ = ("_start", "inflight", "num_ranks", "server_count", "view")

    def __init__(self, num_ranks: int, server_count: int = 1, server_index: int = 0) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        if not 0 <= server_index < server_count:
            raise ValueError(f"server_index={server_index} must be in [0, {server_count})")
        self.num_ranks = num_ranks
        self.server_count = server_count
        # Servers start their scans at different ranks, so a burst over idle ranks spreads.
        self._start = num_ranks * server_index // server_count
        self.view: list[list[float]] = [[0, 0, 0.0] for _ in range(num_ranks)]
        self.inflight = [0] * num_ranks

    def score(self, rank: int) -> float:
        """The rank's score: lower is less loaded."""
        waiting, running, kv_usage = self.view[rank]
        score = max(self.server_count * self.inflight[rank], waiting + running)
        if waiting and kv_usage > 0.5:
            # A queue drains slowly where KV is short: up to 3x its length at a full cache.
            score += waiting * 6.0 * (kv_usage - 0.5)
        return score

    def route(self) -> int:
        """Choose the rank for this server's next request and count it as sent there."""
        n = self.num_ranks
        best = self._start
        best_score = self.score(best)
        for i in range(1, n):
            r = (self._start + i) % n
            s = self.score(r)
            if s < best_score:
                best, best_score = r, s
        self.view[best][0] += self.server_count
        self.inflight[best] += 1
        self._start = (self._start + 1) % n
        return best

    def finished(self, rank: int) -> None:
        """One of this server's requests on ``rank`` finished."""
        self.inflight[rank] -= 1

    def snapshot(self, counts: list[tuple[int, int, float]]) -> None:
        """The coordinator's new (waiting, running, KV usage) per rank, replacing the last."""
        self.view = [[w, r, kv] for w, r, kv in counts]
