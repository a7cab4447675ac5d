"""Data-parallel ranks on other hosts (``--headless`` processes, Ray actors), as the API server sees them.

A remote rank is the ordinary engine process at the far end of a TCP link
(``dp_link``) instead of a pipe; ``RemoteRank`` gives the API server the
same methods as ``ProcessBackend`` for a local one. The API server accepts
the ranks' joins (``accept_ranks``) before it binds its HTTP port, and gives
up after the join timeout naming the ranks that never came.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from socket import socket

from llmsched.core.errors import ConfigError
from llmsched.engine.dp.proc_transport import describe_exit
from llmsched.server.dp_link import HANDSHAKE_S, Join, JoinReply, Link, RankExit, accept
from llmsched.server.engine_loop import Command
from llmsched.server.engine_messages import BATCH_TAG, Dead, EngineInfo, Stop, decode_batch
from llmsched.server.process_backend import STOP_TIMEOUT_S

log = logging.getLogger("llmsched.server")


class RemoteRank:
    """One rank on another host, over its link (a server-side stand-in for ProcessBackend)."""

    def __init__(self, link: Link, join: Join) -> None:
        self.link = link
        self.where = join.where
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._info: EngineInfo | None = None
        self._exit: RankExit | None = None
        self._closed = threading.Event()

    pid = None  # its process runs elsewhere: ``where`` says which

    def describe(self) -> str:
        """Where the rank runs, for messages."""
        return self.where

    def wait_started(self, timeout_s: float) -> None:
        """Wait for the rank's engine to report; ConfigError (link closed) if it does not."""
        msg: object = None
        try:
            if self.link.conn.poll(timeout_s):
                msg = self.link.conn.recv()
        except (EOFError, OSError):
            msg = None
        if not isinstance(msg, EngineInfo):
            self.kill()
            why = msg.message if isinstance(msg, Dead) else f"its link closed or it was silent ({self.where})"
            raise ConfigError(f"the engine did not start: {why}")
        self._info = msg

    def kill(self) -> None:
        """Drop the link; the rank's host stops its engine process when it sees it closed."""
        self.link.close()

    def info(self) -> EngineInfo:
        """The engine's facts, as the rank reported them."""
        assert self._info is not None, "wait_started() first"
        return self._info

    def start(self, deliver: Callable[[object], None]) -> None:
        """Start relaying the rank's messages to ``deliver`` on the calling event loop."""
        aio = asyncio.get_running_loop()
        conn = self.link.conn

        def read() -> None:
            # After the engine's own Dead (it stopped), read on until the link closes: the far side
            # closes it once the engine process has exited, so a stop never looks like a loss there.
            dead_sent = False
            try:
                while True:
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        if not dead_sent:
                            _deliver(aio, deliver, Dead(f"the link to {self.where} closed"))
                        return
                    if isinstance(msg, RankExit):
                        self._exit = msg
                        continue
                    if dead_sent:
                        continue
                    if isinstance(msg, tuple) and msg and msg[0] == BATCH_TAG:
                        msg = decode_batch(msg)
                    if not _deliver(aio, deliver, msg):
                        return
                    dead_sent = isinstance(msg, Dead)
            finally:
                self._closed.set()

        self._reader = threading.Thread(target=read, name="llmsched-remote-rank-reader", daemon=True)
        self._reader.start()

    def send(self, cmd: Command) -> None:
        """Send a command to the rank; safe from any thread."""
        try:
            with self._send_lock:
                self.link.conn.send(cmd)
        except (OSError, ValueError):
            log.warning("the link to %s is gone; dropped %s", self.where, type(cmd).__name__)

    def describe_end(self, message: str) -> str:
        """How the rank ended, as far as this side can tell (its host's word when it sent one)."""
        self._closed.wait(0.5)
        if self._exit is not None:
            return f"({self.where}) {describe_exit(self._exit.code)}"
        return f"({self.where}) was lost: its link closed (that process ended, or the network failed)"

    async def stop(self) -> None:
        """Stop the rank and wait for its link to close (dropping it if it does not in time)."""
        self.send(Stop())
        if self._reader is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._closed.wait, STOP_TIMEOUT_S)
        self.link.close()


def _deliver(aio: asyncio.AbstractEventLoop, deliver: Callable[[object], None], msg: object) -> bool:
    """Hand ``msg`` to the event loop; False once it has closed."""
    try:
        aio.call_soon_threadsafe(deliver, msg)
    except RuntimeError:
        return False
    return True


def _say(line: str) -> None:
    print(f"llmsched serve: {line}", file=sys.stderr, flush=True)


def _join_error(msg: object, waiting: set[int], size: int) -> str | None:
    if not isinstance(msg, Join):
        return "no join request came"
    if msg.size != size:
        return f"it has --data-parallel-size {msg.size}, this API server {size}"
    if msg.rank not in waiting:
        return f"rank {msg.rank} is not one this API server waits for (it waits for {sorted(waiting)})"
    return None


def accept_ranks(
    server: socket,
    key: bytes,
    expected: Iterable[int],
    size: int,
    timeout_s: float,
    hint: str,
    watch: Callable[[], str | None] | None = None,
) -> dict[int, RemoteRank]:
    """Accept a join from each expected rank within ``timeout_s``; ConfigError naming the missing ones.

    ``watch``, asked every second, may name a failure that means waiting on is pointless.
    """
    waiting = set(expected)
    joined: dict[int, RemoteRank] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while waiting:
            link = accept(server, key, min(deadline, time.monotonic() + 1.0))
            if link is None:
                failure = watch() if watch is not None else None
                if failure is not None:
                    raise ConfigError(f"data-parallel ranks could not join: {failure}")
                if time.monotonic() < deadline:
                    continue
                raise ConfigError(
                    f"data-parallel rank(s) {', '.join(map(str, sorted(waiting)))} did not join within "
                    f"{timeout_s:g} s (--data-parallel-join-timeout): {hint}"
                )
            msg: object = None
            try:
                if link.conn.poll(HANDSHAKE_S):
                    msg = link.conn.recv()
            except (EOFError, OSError):
                msg = None
            error = _join_error(msg, waiting, size)
            try:
                link.conn.send(JoinReply(error))
            except OSError:
                error = error or "it left during its join"
            if error is not None:
                _say(f"refused a data-parallel join from {link.peer}: {error}")
                link.close()
                continue
            assert isinstance(msg, Join)
            waiting.discard(msg.rank)
            joined[msg.rank] = RemoteRank(link, msg)
            _say(f"data-parallel rank {msg.rank} joined ({msg.where})")
    except BaseException:
        for r in joined.values():
            r.kill()
        raise
    return joined
