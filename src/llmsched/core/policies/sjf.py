"""Shortest job first, with aging so that nothing waits forever."""

from __future__ import annotations

from llmsched.core.policies.base import BasePolicy, KeyedQueue, remaining_tokens
from llmsched.core.policy_seam import WaitingQueue
from llmsched.core.request import Request


class SJFPolicy(BasePolicy):
    """Fewest remaining tokens (prompt left plus output left) first, aged by waiting time.

    A request's rank is ``remaining - aging * (now - arrival)``. The ``now``
    term is the same for every request, so the key ``remaining + aging *
    arrival`` is fixed when a request is queued: a heap, no re-sorting. It
    also bounds the wait: a request with R remaining tokens is ahead of
    every request arriving more than ``R / aging_tokens_per_s`` seconds after
    it, so only finitely many can ever overtake it.

    The output estimate is ``max_tokens`` capped at ``output_cap``: exact
    when clients set max_tokens to what they expect, an upper bound otherwise.
    """

    name = "sjf"
    KNOBS = {"aging_tokens_per_s": 100.0, "output_cap": 4096}

    def _key(self, req: Request) -> float:
        return (
            remaining_tokens(req, self.knobs["output_cap"])
            + self.knobs["aging_tokens_per_s"] * req.arrival_time
        )

    def make_queue(self) -> WaitingQueue:
        """A heap on the aged remaining-token key."""
        return KeyedQueue(self._key)

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """The running request with the most work left (ties: latest admitted); none for a waiting one."""
        if for_request is not None:
            return None
        cap = self.knobs["output_cap"]
        best = running[-1]
        most = remaining_tokens(best, cap)
        for r in reversed(running):
            left = remaining_tokens(r, cap)
            if left > most:
                best, most = r, left
        return best
