"""What the front end and the ranks exchange, and the interface every transport implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llmsched.core.request import Request
from llmsched.engine.engine_core import EngineStep


@dataclass(slots=True)
class RankStatus:
    """What lock-stepped ranks all-gather after each step."""

    running: int
    waiting: int
    unfinished: bool


@dataclass(slots=True)
class TokenOutput:
    """One request's progress in one step: its new tokens, and how it ended if it did.

    ``finish_reason`` is "stop", "length", "abort" or "error" once finished;
    ``error`` says why for "error".
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        """True once the request ended."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RankReport:
    """One rank's step, as the front end sees it.

    ``time`` is when the step ended: simulated seconds for the simulator,
    ``time.monotonic()`` for real ranks. ``num_received`` counts the requests
    the rank had been sent when it reported, for the router's bookkeeping.
    ``engine_step`` is the step itself where the rank runs in this process.
    """

    rank: int
    outputs: list[TokenOutput] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    num_received: int = 0
    num_preemptions: int = 0
    time: float = 0.0
    executed: bool = False
    engine_step: EngineStep | None = None


class DPRankError(RuntimeError):
    """A rank failed; the message names the rank and why.

    ``outputs``: every request the engine still owed, finished with
    ``finish_reason`` "error".
    """

    def __init__(self, rank: int, reason: str, outputs: Sequence[TokenOutput] = ()) -> None:
        super().__init__(f"data-parallel rank {rank} failed: {reason}")
        self.rank = rank
        self.reason = reason
        self.outputs = list(outputs)


class DPTransport(Protocol):
    """Moves requests to ranks and their progress back; simulated or real."""

    num_ranks: int

    def add_request(self, rank: int, request: Request) -> None:
        """Send a request to ``rank``; raises RequestRejected if the rank refuses it."""
        ...

    def abort_requests(self, rank: int, request_ids: Sequence[str]) -> None:
        """Abort requests on ``rank``; unknown or finished ids are ignored."""
        ...

    def has_work(self) -> bool:
        """True while any rank may still produce a report."""
        ...

    def step(self, timeout: float | None = None) -> list[RankReport]:
        """Make progress: the reports of the steps that completed (maybe none before ``timeout``).

        Raises DPRankError when a rank has failed.
        """
        ...

    def close(self) -> None:
        """Stop every rank and release them."""
        ...
