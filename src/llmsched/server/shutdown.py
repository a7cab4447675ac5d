"""Graceful shutdown: on SIGTERM or Ctrl-C stop accepting, let requests finish, abort the rest, exit 0.

uvicorn closes the listening socket and waits for open responses; before
that, the engine is put in drain mode (new requests and /health get 503)
and a timer aborts whatever is still running once the drain window has
passed, so every client gets an answer or a clean error (503 JSON, or an
error event on a stream) instead of a cut connection. uvicorn would raise
SIGTERM again after its shutdown, killing the process with that signal;
a drained shutdown is a clean exit, so it is not re-raised.

A second Ctrl-C ends the drain at once, but not by cancelling the
responses under way (uvicorn's forced exit, which logs each as an ASGI
exception and leaves its client a cut stream): every request still running
is aborted now, so each stream ends with its error event and ``[DONE]``,
and the exit waits up to ``CUT_GRACE_S`` for those to go out. A third
Ctrl-C exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from llmsched.server.state import ServerState

log = logging.getLogger("llmsched.server")
# Seconds the aborted requests' answers get to go out after the drain window.
ABORT_GRACE_S = 5.0
# Seconds the answers of requests cut by a second Ctrl-C get to go out.
CUT_GRACE_S = 2.0


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains the engine before it stops."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cutting = False

    async def startup(self, sockets: list | None = None) -> None:
        """Remember the event loop the signal handler must reach."""
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain, then stop; a second Ctrl-C cuts every request cleanly; a third exits."""
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            self._captured_signals.remove(sig)
        if self._loop is None:
            return
        if first:
            self._loop.call_soon_threadsafe(self.begin_drain)
        elif self.force_exit and not self._cutting:
            # uvicorn would stop waiting and cancel the responses mid-stream; keep it
            # waiting for them while they end with an error instead.
            self._cutting = True
            self.force_exit = False
            self._loop.call_soon_threadsafe(self.cut_now)

    def begin_drain(self) -> None:
        """Refuse new requests now; abort the running ones after the drain window."""
        engine = self.state.engine
        timeout = self.state.args.shutdown_timeout_s
        log.info("shutting down: %d requests in flight get %.0f s to finish", engine.num_streams, timeout)
        engine.drain()
        asyncio.get_running_loop().call_later(timeout, self._abort_rest)

    def cut_now(self) -> None:
        """Abort every request now (each client gets its error), and exit once they are answered."""
        n = self.state.engine.abort_all("the server is shutting down")
        log.info("shutting down now: aborted %d requests in flight", n)
        asyncio.get_running_loop().call_later(CUT_GRACE_S, self._force_exit)

    def _force_exit(self) -> None:
        self.force_exit = True

    def _abort_rest(self) -> None:
        n = self.state.engine.abort_all("the server is shutting down")
        if n:
            log.info("shutting down: aborted %d requests that did not finish in time", n)
