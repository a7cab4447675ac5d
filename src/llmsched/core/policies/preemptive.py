"""Priority that preempts: a waiting request of higher priority takes a lower one's place."""

from __future__ import annotations

from llmsched.core.policies.base import PriorityOrderPolicy
from llmsched.core.policy_seam import _priority_key
from llmsched.core.request import Request


class PriorityPreemptivePolicy(PriorityOrderPolicy):
    """vLLM's priority order, plus: when the waiting request next in line does
    not fit (KV blocks or ``max_num_seqs``), the lowest-ranked running request
    whose priority value is at least ``min_priority_gap`` larger is preempted
    for it, repeatedly, until it fits or no such request is left.

    Requests admitted in the same step are never victims, and a victim is
    not resumed in the step that preempted it.
    """

    name = "priority-preemptive"
    KNOBS = {"min_priority_gap": 1}

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """The lowest-ranked running request; for a waiting one, only if it ranks low enough."""
        victim = max(running, key=_priority_key)
        if for_request is None:
            return victim
        if victim.priority >= for_request.priority + self.knobs["min_priority_gap"]:
            return victim
        return None
