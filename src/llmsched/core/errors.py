"""Errors raised on bad input: each names the field or request at fault."""

from __future__ import annotations


class ConfigError(ValueError):
    """An engine or scheduler setting is invalid; the message names the field."""


class RequestRejected(ValueError):
    """A request cannot be accepted (over-long prompt, duplicate id, ...).

    Raised by ``add_request``; the scheduler's state is untouched, so other
    requests are never affected.
    """


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names it."""
