"""The ``--scheduling-policy`` and ``--policy-config`` flags, shared by every command."""

from __future__ import annotations

import argparse

from llmsched.core.errors import ConfigError
from llmsched.core.json_object import parse_json_object
from llmsched.core.policies import POLICY_NAMES, check_name

POLICY_HELP = (
    f"scheduling policy: one of {', '.join(POLICY_NAMES)}; an ordering policy with "
    "'+skip-admission' (e.g. fair+skip-admission); or 'module:Class' for a class of your own "
    "(see the README's 'Scheduling policies'). fcfs and priority are vLLM's, decision for decision"
)
POLICY_CONFIG_HELP = (
    "the policy's knobs as a JSON object, e.g. '{\"aging_tokens_per_s\": 50}' for sjf "
    "(unknown keys are refused, naming the known ones)"
)


def policy_name(text: str) -> str:
    """argparse type: a valid policy name."""
    try:
        check_name(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def policy_config(text: str) -> dict:
    """argparse type: a JSON object."""
    try:
        return parse_json_object(text, "--policy-config")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_policy_args(group: argparse._ActionsContainer, default: str | None = "fcfs") -> None:
    """Add both flags to ``group``; ``default`` None leaves the policy to the input (replay)."""
    group.add_argument(
        "--scheduling-policy", type=policy_name, default=default, metavar="NAME", help=POLICY_HELP
    )
    group.add_argument(
        "--policy-config", type=policy_config, default=None, metavar="JSON", help=POLICY_CONFIG_HELP
    )
