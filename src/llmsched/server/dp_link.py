"""The TCP link between the API server and data-parallel ranks on other hosts (or in Ray actors).

A link is a ``multiprocessing.connection.Connection`` over a TCP socket,
authenticated as multiprocessing's Listener and Client do (an HMAC
challenge each way on a shared key), so it carries the same pickled
commands and step batches as the pipe to a local engine process. Only an
authenticated peer's pickles are ever read. A rank joins with ``Join``;
the API server answers ``JoinReply``. A headless host ends a rank's link
with ``RankExit`` when its engine process ended. TCP keepalive makes a
peer whose host vanished (no FIN) show up as a closed link within seconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from llmsched.core.errors import ConfigError

AUTHKEY_ENV = "LLMSCHED_DP_AUTHKEY"
DEFAULT_RPC_PORT = 29550  # vLLM's default --data-parallel-rpc-port
DEFAULT_ADDRESS = "127.0.0.1"
# How long a peer gets for the authentication and join exchange.
HANDSHAKE_S = 10.0
# Keepalive: first probe after this many idle seconds, then every interval, KEEPALIVE_PROBES times.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 2, 1, 3


@dataclass(frozen=True, slots=True)
class Join:
    """A rank asking the API server for its place: which rank, of how many, and where it runs."""

    rank: int
    size: int
    where: str


@dataclass(frozen=True, slots=True)
class JoinReply:
    """The API server's answer to a Join: None to go ahead, or why not."""

    error: str | None


@dataclass(frozen=True, slots=True)
class RankExit:
    """A rank's engine process ended with this exit code (None: unknown), sent before the link closes."""

    code: int | None


class Link:
    """One authenticated TCP connection; ``shutdown`` wakes a thread blocked reading it."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self.peer = peer
        self.conn = Connection(os.dup(sock.fileno()))

    def shutdown(self) -> None:
        """End the connection both ways: the peer and any local reader see it closed at once."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Release the connection."""
        self.shutdown()
        self.conn.close()
        self._sock.close()


def authkey_from_env() -> bytes:
    """The shared secret every host of a data-parallel group reads from LLMSCHED_DP_AUTHKEY."""
    key = os.environ.get(AUTHKEY_ENV, "")
    if not key:
        raise ConfigError(
            f"data-parallel ranks on other hosts need a shared secret: set {AUTHKEY_ENV} to the same value "
            f"on every host (for example `export {AUTHKEY_ENV}=$(openssl rand -hex 32)`)"
        )
    return key.encode()


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _handshake(sock: socket.socket, peer: str, key: bytes, *, server: bool) -> Link:
    """Authenticate both ways within HANDSHAKE_S (a silent peer is cut off, not waited on)."""
    sock.settimeout(None)
    _keepalive(sock)
    link = Link(sock, peer)
    timer = threading.Timer(HANDSHAKE_S, link.shutdown)
    timer.start()
    try:
        if server:
            deliver_challenge(link.conn, key)
            answer_challenge(link.conn, key)
        else:
            answer_challenge(link.conn, key)
            deliver_challenge(link.conn, key)
    except (AuthenticationError, EOFError, OSError) as e:
        link.close()
        raise ConnectionError(f"{peer}: authentication failed ({type(e).__name__}: {e})") from None
    finally:
        timer.cancel()
    return link


def listen(address: str, port: int) -> socket.socket:
    """A listening TCP socket for ranks to join (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        return socket.create_server((address, port), family=family, backlog=64)
    except OSError as e:
        raise ConfigError(
            f"cannot listen for data-parallel ranks on {address}:{port} "
            f"(--data-parallel-address/--data-parallel-rpc-port): {e}"
        ) from None


def accept(server: socket.socket, key: bytes, deadline: float) -> Link | None:
    """The next authenticated connection, or None at the deadline; an impostor is dropped with a line."""
    while (left := deadline - time.monotonic()) > 0:
        server.settimeout(min(left, 1.0))
        try:
            sock, addr = server.accept()
        except TimeoutError:
            continue
        try:
            return _handshake(sock, f"{addr[0]}:{addr[1]}", key, server=True)
        except ConnectionError as e:
            print(f"llmsched serve: refused a data-parallel connection: {e}", file=sys.stderr, flush=True)
    return None


def connect(address: str, port: int, key: bytes, deadline: float) -> Link:
    """Connect to the API server, retrying until it listens or the deadline passes."""
    while True:
        try:
            sock = socket.create_connection((address, port), timeout=HANDSHAKE_S)
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"no API server answered at {address}:{port} (--data-parallel-address/"
                    f"--data-parallel-rpc-port): {e}"
                ) from None
            time.sleep(0.5)
    try:
        return _handshake(sock, f"{address}:{port}", key, server=False)
    except ConnectionError as e:
        raise ConfigError(f"the API server refused this host: {e} (is {AUTHKEY_ENV} the same?)") from None


def join(link: Link, rank: int, size: int, where: str) -> None:
    """Ask for ``rank``'s place; ConfigError with the API server's reason if refused."""
    reply = None
    try:
        link.conn.send(Join(rank, size, where))
        if link.conn.poll(HANDSHAKE_S):
            reply = link.conn.recv()
    except (EOFError, OSError):
        pass
    if not isinstance(reply, JoinReply):
        link.close()
        raise ConfigError(f"the API server at {link.peer} did not answer rank {rank}'s join")
    if reply.error is not None:
        link.close()
        raise ConfigError(f"the API server at {link.peer} refused rank {rank}: {reply.error}")
