"""Earliest TTFT deadline first, declining work that cannot meet its deadline."""

from __future__ import annotations

from llmsched.core.policies.base import BasePolicy, KeyedQueue
from llmsched.core.policy_seam import Refusal, Verdict, WaitingQueue
from llmsched.core.request import Request
from llmsched.core.trace import Reason


class SLOPolicy(BasePolicy):
    """Deadline = arrival + ``ttft_slo_s``; the earliest deadline goes first.

    With ``decline`` on, a request about to be admitted whose first token
    cannot come by its deadline (now plus its prompt at
    ``prefill_tokens_per_s`` is past it) is finished unserved, reason
    ``declined_for_deadline``: under overload the engine spends its time on
    requests that can still meet the SLO. A preempted request that already
    produced output is never declined.
    """

    name = "slo"
    KNOBS = {"ttft_slo_s": 1.0, "decline": True, "prefill_tokens_per_s": 20000.0}

    def deadline(self, req: Request) -> float:
        """When ``req``'s first token is due."""
        return req.arrival_time + self.knobs["ttft_slo_s"]

    def make_queue(self) -> WaitingQueue:
        """A heap on the deadline."""
        return KeyedQueue(self.deadline)

    def admit(self, request: Request, blocked: tuple[Reason, str] | None) -> Refusal | None:
        """Decline a request that would miss its deadline; otherwise try it."""
        if blocked is not None:
            return self.skip_refusal(request, blocked)
        sched = self.sched
        if not self.knobs["decline"] or sched is None or request.num_tokens > request.num_prompt_tokens:
            return None
        rate = self.knobs["prefill_tokens_per_s"]
        left = request.num_tokens - request.num_computed_tokens
        now = sched.clock()
        due = self.deadline(request)
        eta = now + (left / rate if rate else 0.0)
        if eta > due:
            late = eta - due
            return Verdict.DECLINE, Reason.DEADLINE_DECLINED, f"first token ~{late:.3f} s past its deadline"
        return None
