"""The latest engine steps with the scheduler's decisions, kept for GET /debug/steps.

The engine loop appends one record per step to a bounded deque and answers
queries from it between steps, so memory stays bounded whatever the uptime
and a record is never read while it is written.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from llmsched.core.trace import StepTrace


@dataclass(slots=True)
class StepRecord:
    """One engine step as the server saw it; ``time`` is wall-clock seconds (Unix epoch)."""

    step: int
    time: float
    duration_ms: float
    # CPU time the engine thread spent in the step; below duration_ms when it
    # waited (for the GPU, or for a core on a busy machine).
    cpu_ms: float
    num_running: int
    num_waiting: int
    kv_usage: float
    num_scheduled_tokens: int
    # Requests queued and aborted since the previous step, then what the step did.
    added: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    trace: StepTrace | None = None

    def to_json(self, explain: bool = False) -> dict:
        """The record as JSON; ``why`` is the trace's entries, ``explain`` its text when asked."""
        out: dict = {
            "step": self.step,
            "time": self.time,
            "duration_ms": self.duration_ms if math.isfinite(self.duration_ms) else None,
            "cpu_ms": self.cpu_ms if math.isfinite(self.cpu_ms) else None,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_cache_usage": self.kv_usage,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "added": self.added,
            "aborted": self.aborted,
            "admitted": self.admitted,
            "preempted": self.preempted,
            "finished": self.finished,
            "why": self.trace.to_json() if self.trace is not None else None,
        }
        if explain and self.trace is not None:
            out["explain"] = self.trace.explain()
        return out


class StepLog:
    """A ring buffer of the last ``capacity`` StepRecords."""

    __slots__ = ("_records", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._records: deque[StepRecord] = deque(maxlen=max(capacity, 1))

    def append(self, record: StepRecord) -> None:
        """Keep a record (the oldest goes when full)."""
        if self.capacity:
            self._records.append(record)

    def last(self, n: int) -> list[StepRecord]:
        """The latest ``n`` records, oldest first."""
        records = list(self._records)
        return records[-n:] if n > 0 else []
