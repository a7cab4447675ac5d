"""Graceful shutdown: on SIGTERM or Ctrl-C stop accepting, let requests finish, abort the rest, exit 0.

uvicorn closes the listening socket and waits for open responses; before
that, the engine is put in drain mode (new requests and /health get 503)
and a timer aborts whatever is still running once the drain window has
passed, so every client gets an answer or a clean error (503 JSON, or an
error event on a stream) instead of a cut connection. uvicorn would raise
SIGTERM again after its shutdown, killing the process with that signal;
a drained shutdown is a clean exit, so it is not re-raised.
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


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains the engine before it stops."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list | None = None) -> None:
        """Remember the event loop the signal handler must reach."""
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain, then stop; a second Ctrl-C forces the exit as uvicorn does."""
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            self._captured_signals.remove(sig)
        if first and self._loop is not None:
            self._loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """Refuse new requests now; abort the running ones after the drain window."""
        engine = self.state.engine
        timeout = self.state.args.shutdown_timeout_s
        log.info("shutting down: %d requests in flight get %.0f s to finish", engine.num_streams, timeout)
        engine.drain()
        asyncio.get_running_loop().call_later(timeout, self._abort_rest)

    def _abort_rest(self) -> None:
        n = self.state.engine.abort_all("the server is shutting down")
        if n:
            log.info("shutting down: aborted %d requests that did not finish in time", n)
