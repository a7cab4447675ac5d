"""`llmsched serve --headless`: this host's data-parallel ranks, joined to an API server on another host.

Each rank is the ordinary engine process, started here on a pipe as for
the API server's own ranks; this process joins it to the API server over
an authenticated TCP link (``dp_link``) and relays the pipe's frames both
ways, unchanged. Holding the links here, rather than in the engine
processes, ties the ranks' fate to this process: if it is killed, the
kernel closes its links (the API server notices at once and ends those
ranks' requests) and its pipes (the engine processes stop). If the API
server's side closes, the rank's engine process is stopped and this
process exits, saying so.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.dp_args import dp_layout
from llmsched.server.dp_link import Link, RankExit, authkey_from_env, connect, join
from llmsched.server.engine_messages import Stop
from llmsched.server.process_backend import STOP_TIMEOUT_S, engine_process_main


def _say(line: str) -> None:
    print(f"llmsched serve --headless: {line}", file=sys.stderr, flush=True)


class HeadlessRank:
    """One rank's engine process and the relay between its pipe and its link."""

    def __init__(self, rank: int, link: Link, engine_args: EngineArgs, server_args: ServerArgs) -> None:
        self.rank = rank
        self.link = link
        self.lost = False
        self._stopping = False
        self._ended = threading.Event()  # the engine process's side ended first
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        kv_sample = server_args.kv_cache_metrics_sample if server_args.kv_cache_metrics else 0.0
        self.process = ctx.Process(
            target=engine_process_main,
            args=(
                child,
                engine_args,
                server_args.admission_window_ms,
                server_args.trace_steps,
                kv_sample,
                server_args.prefault_kv_cache,
            ),
            name=f"llmsched-engine-dp{rank}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self.threads = [
            threading.Thread(target=self._up, name=f"llmsched-dp{rank}-up", daemon=True),
            threading.Thread(target=self._down, name=f"llmsched-dp{rank}-down", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _up(self) -> None:
        """Engine process -> API server; when the engine process ends, say how, then close the link."""
        _relay(self.pipe, self.link.conn)
        self._ended.set()
        self.process.join(5)
        with contextlib.suppress(OSError, ValueError):
            self.link.conn.send(RankExit(self.process.exitcode))
        self.link.shutdown()

    def _down(self) -> None:
        """API server -> engine process; a closed link stops the engine process (its pipe closes)."""
        _relay(self.link.conn, self.pipe)
        if not self._ended.is_set() and not self._stopping:
            self.lost = True
            _say(
                f"lost the API server at {self.link.peer} (rank {self.rank}'s link closed); stopping the rank"
            )
        # This thread is the pipe's only writer; the engine process drains and exits on Stop.
        with contextlib.suppress(OSError, ValueError):
            self.pipe.send(Stop())

    def alive(self) -> bool:
        """Whether either direction is still relaying."""
        return any(t.is_alive() for t in self.threads)

    def stop(self) -> None:
        """Close the link (the API server sees the rank go) and let the engine process stop."""
        self._stopping = True
        self.link.shutdown()
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def _relay(src: Connection, dst: Connection) -> None:
    """Copy frames from ``src`` to ``dst`` until either side closes."""
    try:
        while True:
            dst.send_bytes(src.recv_bytes())
    except (EOFError, OSError, ValueError):
        return


def _join_all(engine_args: EngineArgs, server_args: ServerArgs) -> list[tuple[int, Link]]:
    layout = dp_layout(server_args)
    key = authkey_from_env()
    deadline = time.monotonic() + layout.join_timeout_s
    ranks = range(layout.start_rank, layout.start_rank + layout.local)
    where = f"headless process {os.getpid()} on {socket.gethostname()}"
    links: list[tuple[int, Link]] = []
    try:
        for r in ranks:
            link = connect(layout.address, layout.port, key, deadline)
            links.append((r, link))
            join(link, r, layout.size, where)
    except BaseException:
        for _, link in links:
            link.close()
        raise
    return links


def run_headless(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """Start this host's ranks, joined to the API server; exit 0 when it stops them, 1 if it is lost."""
    from llmsched.server.dp_backend import threads_per_rank

    layout = dp_layout(server_args)
    if engine_args.usage_context is None:
        engine_args = replace(engine_args, usage_context="OPENAI_API_SERVER")
    if engine_args.num_threads is None:
        engine_args = replace(engine_args, num_threads=threads_per_rank(layout.local))
    last = layout.start_rank + layout.local - 1
    _say(f"ranks {layout.start_rank}..{last} of {layout.size} joining {layout.address}:{layout.port}")
    links = _join_all(engine_args, server_args)
    ranks = [HeadlessRank(r, link, engine_args, server_args) for r, link in links]
    _say(f"ranks {layout.start_rank}..{last} joined; serving until the API server stops them")

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    interrupted = False
    try:
        while any(r.alive() for r in ranks):
            time.sleep(0.2)
    except (KeyboardInterrupt, SystemExit):
        interrupted = True
        _say("stopping on a signal: the API server will see these ranks leave")
    finally:
        for r in ranks:
            r.stop()
    if any(r.lost for r in ranks):
        return 1
    if not interrupted:
        _say("the API server stopped these ranks")
    return 0
