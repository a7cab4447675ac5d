"""The scheduling-policy seam: waiting-queue order, admission, preemption victim; a policy by name.

The seam's types (``Policy``, ``SchedulerView``, the waiting queues, FCFS and priority) are
defined in ``llmsched.core.policy_seam`` so that the policies beyond vLLM's
(``llmsched.core.policies``) build on them without importing this module;
it re-exports them and picks a policy by name from both.
"""

from __future__ import annotations

from llmsched.core.policies import build, check_name
from llmsched.core.policy_seam import (
    POLICIES,
    FCFSPolicy,
    FCFSQueue,
    Policy,
    PriorityPolicy,
    PriorityQueue,
    Refusal,
    SchedulerView,
    Verdict,
    WaitingQueue,
    _priority_key,
)

__all__ = [
    "POLICIES",
    "FCFSPolicy",
    "FCFSQueue",
    "Policy",
    "PriorityPolicy",
    "PriorityQueue",
    "Refusal",
    "SchedulerView",
    "Verdict",
    "WaitingQueue",
    "_priority_key",
    "check_policy_name",
    "make_policy",
]


def make_policy(name: str, config: dict | None = None) -> Policy:
    """The policy called ``name`` (see ``llmsched.core.policies.build``), set up by ``config``."""
    if name in POLICIES and not config:
        return POLICIES[name]()
    return build(name, config or {})


def check_policy_name(name: str) -> None:
    """Raise ConfigError unless ``name`` names a policy (``module:Class`` is checked when loaded)."""
    check_name(name)
