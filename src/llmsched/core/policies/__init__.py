"""Scheduling policies beyond vLLM's FCFS and priority, and how a name picks one.

A name is one ordering policy, optionally followed by ``+skip-admission``:

- ``fcfs``, ``priority``: vLLM's (exact); ``llmsched.core.policy``.
- ``sjf``: fewest remaining tokens first, aged so nothing waits forever.
- ``fair``: per-tenant fair share by a virtual token counter (VTC).
- ``priority-preemptive``: priority, and a waiting request of higher
  priority preempts lower-priority running work.
- ``lpm``: longest prefix-cache match first.
- ``slo``: earliest TTFT deadline first; declines what would miss it.
- ``skip-admission`` (alone: FCFS order): a waiting request that does not
  fit is skipped, not a stop for the whole queue. Combines with every
  ordering policy (``fair+skip-admission``, ``sjf+skip-admission``, ...).
  Two ordering policies never combine: each is a whole queue order.
- ``module:Class``: a class of your own implementing ``llmsched.core.policy.Policy``,
  built with ``Class(**policy_config)`` (``Class()`` without a config).
"""

from __future__ import annotations

import importlib

from llmsched.core.errors import ConfigError
from llmsched.core.policies.base import BasePolicy, PriorityOrderPolicy
from llmsched.core.policies.fair import FairPolicy
from llmsched.core.policies.lpm import LPMPolicy
from llmsched.core.policies.preemptive import PriorityPreemptivePolicy
from llmsched.core.policies.sjf import SJFPolicy
from llmsched.core.policies.slo import SLOPolicy
from llmsched.core.policy_seam import POLICIES, Policy

ORDERS: dict[str, type[BasePolicy]] = {
    "fcfs": BasePolicy,
    "priority": PriorityOrderPolicy,
    "sjf": SJFPolicy,
    "fair": FairPolicy,
    "priority-preemptive": PriorityPreemptivePolicy,
    "lpm": LPMPolicy,
    "slo": SLOPolicy,
}
SKIP = "skip-admission"
# Every built-in name, for --help and error messages.
POLICY_NAMES = [*ORDERS, SKIP]

__all__ = ["ORDERS", "POLICY_NAMES", "build", "check_name", "uses_priority"]


def _parse(name: str) -> tuple[str, bool]:
    """(ordering policy, skip-admission on) for a built-in name."""
    parts = name.split("+")
    skip = SKIP in parts
    orders = [p for p in parts if p != SKIP]
    unknown = [p for p in orders if p not in ORDERS]
    if unknown or len(orders) > 1 or parts.count(SKIP) > 1 or not name:
        why = (
            f"unknown policy {unknown[0]!r}"
            if unknown
            else "at most one ordering policy, optionally with +skip-admission"
        )
        raise ConfigError(
            f"scheduling policy {name!r}: {why}; choose one of {', '.join(POLICY_NAMES)}, "
            f"'ORDER+skip-admission', or 'module:Class'"
        )
    return (orders[0] if orders else "fcfs"), skip


def check_name(name: str) -> None:
    """Raise ConfigError unless ``name`` is a built-in policy or has the ``module:Class`` form."""
    if not isinstance(name, str):
        raise ConfigError(f"scheduling policy must be a string, got {name!r}")
    if ":" in name:
        mod, _, cls = name.partition(":")
        if not mod or not cls:
            raise ConfigError(f"scheduling policy {name!r}: a user policy is named 'module:Class'")
        return
    _parse(name)


def uses_priority(name: str) -> bool:
    """Whether requests' priorities mean anything under policy ``name`` (user policies: assumed so)."""
    if ":" in name:
        return True
    return any(p in ("priority", "priority-preemptive") for p in name.split("+"))


def _load_user(name: str, config: dict) -> Policy:
    mod_name, _, cls_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"scheduling policy {name!r} cannot be loaded: {e}") from None
    try:
        policy = cls(**config) if config else cls()
    except TypeError as e:
        raise ConfigError(f"scheduling policy {name!r}: {e}") from None
    missing = [m for m in ("make_queue", "select_victim") if not callable(getattr(policy, m, None))]
    if missing:
        raise ConfigError(f"scheduling policy {name!r} lacks {', '.join(missing)}")
    if not hasattr(policy, "decides_admission"):
        policy.decides_admission = False
    if policy.decides_admission and not callable(getattr(policy, "admit", None)):
        raise ConfigError(f"scheduling policy {name!r} decides admission but has no admit()")
    if not hasattr(policy, "name"):
        policy.name = name
    return policy


def build(name: str, config: dict) -> Policy:
    """The policy ``name`` with its knobs from ``config``."""
    check_name(name)
    if ":" in name:
        return _load_user(name, config)
    order, skip = _parse(name)
    if not skip and order in POLICIES:
        if config:
            raise ConfigError(f"policy {name!r} has no knobs; got policy_config {config!r}")
        return POLICIES[order]()
    return ORDERS[order](config, skip)
