"""The control channel beside the transfer engine: a consumer asks a producer for a request's blocks.

Bytes move through the transfer engine; this only says where they are and
when the reader is done (as vLLM's connectors keep a side channel beside
NIXL or Mooncake). Messages are small tuples over an authenticated
``multiprocessing.connection`` (standard library):

- ``("read", request_id)`` -> ``("ok", engine_name, layout, block_ids, num_tokens)``
  or ``("missing", why)``;
- ``("done", request_id)`` -> ``("ack",)``: the producer may free the blocks.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener

log = logging.getLogger(__name__)

Handler = Callable[[tuple], tuple]


class SideChannelServer:
    """The producer's listener: one thread accepting, one per consumer connection."""

    def __init__(self, host: str, port: int, authkey: bytes, handler: Handler) -> None:
        self._listener = Listener((host, port), authkey=authkey)
        self.address: tuple[str, int] = self._listener.address  # type: ignore[assignment]
        self._handler = handler
        self._closed = False
        threading.Thread(target=self._accept, name="kv-side-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception as e:  # a bad handshake (wrong authkey) must not stop the listener
                if self._closed:
                    return
                log.warning("KV side channel: refused a connection: %s", e)
                continue
            no_delay(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-side-peer", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = self._handler(msg)
                except Exception as e:
                    log.exception("KV side channel: %r failed", msg)
                    reply = ("missing", f"the producer failed: {e}")
                conn.send(reply)

    def close(self) -> None:
        """Stop accepting (connections in progress end with their peers)."""
        self._closed = True
        self._listener.close()


class SideChannelClient:
    """A consumer's connection to one producer; every wait is bounded."""

    def __init__(self, host: str, port: int, authkey: bytes, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._conn = Client((host, port), authkey=authkey)
        no_delay(self._conn)
        self.lock = threading.Lock()

    def call(self, msg: tuple) -> tuple:
        """Send one message and wait for the answer (TimeoutError after ``timeout_s``)."""
        self._conn.send(msg)
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError(f"the producer did not answer {msg[0]!r} within {self.timeout_s:.1f} s")
        return self._conn.recv()

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()


def no_delay(conn: Connection) -> None:
    """Send small messages at once: with Nagle's algorithm a request after the
    authentication exchange waits for a delayed ACK (about 40 ms on Linux)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()
