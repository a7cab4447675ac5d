"""One request's outputs on their way from the engine loop to its HTTP handler.

Everything here runs on the event loop: the engine loop hands a whole
step's outputs over in one message, and that message fills these streams. A
handler that falls behind gets several deltas in one batch and sends them as
one chunk, so a slow client costs one write per step, never a growing queue
of writes.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

from llmsched.server.engine_messages import OutputDelta


class EngineError(RuntimeError):
    """The engine failed this request (or is shutting down); the message says why."""

    # The HTTP status a client gets for it (in the event stream once that started).
    status = 500


class RequestTimedOut(EngineError):
    """The request ran past the server's --request-timeout-s; it was aborted and its blocks freed."""

    status = 504


class ServerShuttingDown(EngineError):
    """The server stopped before the request finished; it was aborted."""

    status = 503


class RequestRejectedByEngine(ValueError):
    """The engine refused the request when it was queued (the message names the reason)."""


class SequenceGroup:
    """The sequences of one request with n > 1, counted as one request in the metrics."""

    __slots__ = ("max_num_tokens", "n", "remaining")

    def __init__(self, n: int) -> None:
        self.n = n
        self.remaining = n
        self.max_num_tokens = 0

    def child_finished(self, num_tokens: int) -> bool:
        """Record one finished sequence; True once all of them have finished."""
        self.max_num_tokens = max(self.max_num_tokens, num_tokens)
        self.remaining -= 1
        return self.remaining == 0


@dataclass(slots=True)
class RequestStream:
    """The per-request mailbox, plus what the server tracks for its metrics and limits."""

    request_id: str
    prompt_len: int
    arrival_time: float
    accepted: asyncio.Future
    items: list[OutputDelta] = field(default_factory=list)
    error: BaseException | None = None
    finished: bool = False
    # The handler's wait, when it is waiting.
    waiter: asyncio.Future | None = None
    # Metrics bookkeeping (event loop only).
    num_tokens: int = 0
    first_token_time: float = math.nan
    last_token_time: float = math.nan
    counts_as_queued: bool = True
    max_tokens: int = 0
    group: SequenceGroup | None = None
    # The OpenAI ``user``: the tenant for fair-share policies and per-tenant metrics.
    tenant: str | None = None
    # The --request-timeout-s timer, cancelled when the request ends.
    timer: asyncio.TimerHandle | None = None
    # A streaming-input session: the acknowledgements its later inputs await, in order.
    input_acks: deque[asyncio.Future] | None = None
    # A session's turn just ended: the wait for its next input is no inter-token gap.
    turn_ended: bool = False
    # The data-parallel rank serving it (as its outputs say).
    rank: int = 0

    def end_timer(self) -> None:
        """Cancel the timeout timer, if any."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def put(self, out: OutputDelta) -> None:
        """Add an engine output; wakes the handler. After ``fail`` outputs are dropped: the error stands."""
        if self.error is not None:
            self.finished = self.finished or out.finished
            return
        self.items.append(out)
        if out.finished:
            self.finished = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream with an error (engine failure or shutdown)."""
        self.error = error
        self.finished = True
        if not self.accepted.done():
            self.accepted.set_exception(error)
            # Marks it retrieved: a handler that has gone never will, and asyncio would warn.
            self.accepted.exception()
        while self.input_acks:
            ack = self.input_acks.popleft()
            if not ack.done():
                ack.set_exception(error)
                ack.exception()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next_batch(self) -> list[OutputDelta]:
        """Every output since the last call (waits for one); raises the stream's error once drained."""
        while not self.items:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items
