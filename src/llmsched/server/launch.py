"""Binding a socket and running uvicorn on the app, in the foreground or on a thread."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
import time

import uvicorn

from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import ExecutorFactory
from llmsched.server.app import build_app
from llmsched.server.args import ServerArgs
from llmsched.server.shutdown import ABORT_GRACE_S, GracefulServer
from llmsched.server.state import ServerState, create_state


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it back with getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def make_server(state: ServerState) -> uvicorn.Server:
    """A uvicorn server for the app over ``state`` that drains the engine when told to stop."""
    config = uvicorn.Config(
        build_app(state),
        log_level=state.args.log_level,
        timeout_graceful_shutdown=state.args.shutdown_timeout_s + ABORT_GRACE_S,
        lifespan="on",
        # The server keeps its own queue limits; uvicorn's would answer 503 without our error shape.
        limit_concurrency=None,
    )
    return GracefulServer(config, state)


def serve(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """Load the model, bind, and serve until interrupted (the `llmsched serve` command)."""
    state = create_state(engine_args, server_args)
    if state.model_notice:
        print(state.model_notice, file=sys.stderr)
    for line in state.startup_log:
        print(f"llmsched serve: {line}", file=sys.stderr)
    sock = bind_socket(server_args.host, server_args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"llmsched serve: model {state.model_name!r} (max_model_len {state.limits.max_model_len}) "
        f"on http://{shown}:{port}/v1",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn re-raises the Ctrl-C it handled once shut down: a clean stop.
    with contextlib.suppress(KeyboardInterrupt):
        make_server(state).run(sockets=[sock])
    return 0


class ServerThread:
    """A real server on 127.0.0.1 (a free port) in a background thread, for tests and benchmarks.

    ``with ServerThread(engine_args, server_args) as s:`` then talk to
    ``s.base_url``; ``s.state`` exposes the server's side of the engine. The
    engine process is started with multiprocessing's spawn, so a script that
    builds one must guard its entry point with ``if __name__ == "__main__"``.
    """

    def __init__(
        self,
        engine_args: EngineArgs,
        server_args: ServerArgs | None = None,
        *,
        executor_factory: ExecutorFactory | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        args = server_args or ServerArgs()
        args.host, args.port = "127.0.0.1", 0
        self.state = create_state(engine_args, args, executor_factory=executor_factory)
        self._server = make_server(self.state)
        self.app = self._server.config.app
        self._sock = bind_socket("127.0.0.1", 0)
        self.port: int = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._run, name="llmsched-uvicorn", daemon=True)
        self._timeout = start_timeout_s
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as e:  # surfaced by __enter__ / stop
            self._error = e

    def start(self) -> ServerThread:
        """Start serving; returns once requests are accepted."""
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the server did not start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in time")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving as on SIGTERM (drain, abort what is left) and join the thread."""
        self._server.handle_exit(signal.SIGTERM, None)
        self._thread.join(self.state.args.shutdown_timeout_s + ABORT_GRACE_S + 30)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
