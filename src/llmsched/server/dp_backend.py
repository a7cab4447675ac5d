"""Data-parallel serving: N engine processes (ranks) behind one API server.

Each rank is the ordinary engine process (``process_backend``): its own
LLMEngine, scheduler and KV cache. The ranks step on their own, as vLLM's
data-parallel ranks of a dense model do; nothing is exchanged between them
(llmsched has no expert parallelism, so a MoE model's ranks need no
lock-step either). The API server routes each new request as one of vLLM
0.33's API servers does, through ``ApiServerRouter``: its own unfinished
requests per rank, and the ranks' queue sizes as last published (at most
every ``SNAPSHOT_INTERVAL_S``, as vLLM's coordinator publishes them). Later
commands for a request (abort, a session's next input or its end) go to the
rank that holds it; adapter loads and unloads go to every rank.

Where the ranks run (``DPLayout``): the first ``local`` as processes of
this host, the others in ``--headless`` processes on other hosts or, with
the ``ray`` backend, all of them as Ray actors; a remote rank is the same
engine loop at the end of a TCP link (``dp_remote``) instead of a pipe.
Every rank must report before the API server binds its port.

Faults: a rank process that dies (SIGKILL, a crash) closes its pipe or
link, which its reader notices at once (a headless host killed closes the
links of all its ranks). The server then does what vLLM's API server does
when an engine core dies: it stops serving. Every request in flight ends
with an error naming the rank, the surviving ranks abort theirs (freeing
their KV blocks), /health answers 503 and new requests are refused.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.dp.router import SNAPSHOT_INTERVAL_S, ApiServerRouter
from llmsched.executor.platform import usable_cores
from llmsched.server.dp_args import DPLayout
from llmsched.server.dp_link import AUTHKEY_ENV, authkey_from_env, listen
from llmsched.server.dp_remote import RemoteRank, accept_ranks
from llmsched.server.engine_loop import Command
from llmsched.server.engine_messages import (
    Abort,
    Acks,
    Add,
    Dead,
    EndInput,
    EngineInfo,
    Failed,
    LoRAOp,
    LoRAReply,
    Query,
    Reply,
    StepBatch,
    Stop,
)
from llmsched.server.process_backend import ProcessBackend


@dataclass(slots=True)
class _Gather:
    """A query or adapter operation sent to several ranks, until each answered."""

    ranks: set[int]
    last: int = 0
    steps: list[dict] = field(default_factory=list)
    error: str | None = None


def threads_per_rank(num_ranks: int) -> int:
    """Torch CPU threads for each rank: the usable CPUs shared out, at least one each."""
    cpus = usable_cores()
    return max(1, cpus // num_ranks)


class DataParallelBackend:
    """Starts ``num_ranks`` engine processes and routes commands to them (a server Backend)."""

    def __init__(
        self,
        engine_args: EngineArgs,
        num_ranks: int,
        *,
        layout: DPLayout | None = None,
        admission_window_ms: float = 0.0,
        trace_steps: int = 256,
        kv_metrics_sample: float = 0.0,
        start_timeout_s: float = 600.0,
        prefault_kv_cache: bool = False,
    ) -> None:
        if num_ranks < 1:
            raise ConfigError(f"num_ranks={num_ranks} must be >= 1")
        layout = layout or DPLayout(num_ranks, num_ranks)
        self.num_ranks = num_ranks
        self._release: Callable[[], None] | None = None
        opts = {
            "admission_window_ms": admission_window_ms,
            "trace_steps": trace_steps,
            "kv_metrics_sample": kv_metrics_sample,
        }
        self.ranks: list[ProcessBackend | RemoteRank] = []
        try:
            if layout.backend == "ray":
                from llmsched.server.dp_ray import start_ray_ranks

                self.ranks, self._release = start_ray_ranks(
                    engine_args, layout, {**opts, "prefault": prefault_kv_cache}
                )
            else:
                self._start_mp(engine_args, layout, opts, prefault_kv_cache)
            # Every rank loads its model at the same time; then each must report.
            for r, b in enumerate(self.ranks):
                try:
                    b.wait_started(start_timeout_s)
                except ConfigError as e:
                    raise ConfigError(f"data-parallel rank {r}: {e}") from None
        except BaseException:
            self._kill_all()
            raise
        self.router = ApiServerRouter(num_ranks)
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}
        # Requests whose first Add has not been acknowledged yet.
        self._unacked: set[str] = set()
        self._gathers: dict[int, _Gather] = {}
        self._counts: list[tuple[int, int, float]] = [(0, 0, 0.0)] * num_ranks
        self._publish: asyncio.TimerHandle | None = None
        self._last_publish = 0.0
        self._deliver: Callable[[object], None] | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.failure: str | None = None
        self._dead_sent = False

    def _start_mp(self, engine_args: EngineArgs, layout: DPLayout, opts: dict, prefault: bool) -> None:
        """Start this host's ranks, then accept the others' joins from --headless hosts."""
        remote = layout.size - layout.local
        key = authkey_from_env() if remote else b""
        if engine_args.num_threads is None:
            engine_args = replace(engine_args, num_threads=threads_per_rank(layout.local))
        server = listen(layout.address, layout.port) if remote else None
        try:
            for r in range(layout.local):
                self.ranks.append(
                    ProcessBackend(
                        engine_args,
                        prefault_kv_cache=prefault,
                        wait=False,
                        name=f"llmsched-engine-dp{r}",
                        **opts,
                    )
                )
            if server is None:
                return
            print(
                f"llmsched serve: waiting for data-parallel ranks {layout.local}..{layout.size - 1} to join "
                f"at {layout.address}:{layout.port}",
                file=sys.stderr,
                flush=True,
            )
            joined = accept_ranks(
                server,
                key,
                range(layout.local, layout.size),
                layout.size,
                layout.join_timeout_s,
                f"start them with `llmsched serve MODEL --headless --data-parallel-size {layout.size} "
                f"--data-parallel-start-rank R --data-parallel-size-local K --data-parallel-address "
                f"{layout.address} --data-parallel-rpc-port {layout.port}` on their hosts, with the same "
                f"{AUTHKEY_ENV}",
            )
            self.ranks.extend(joined[r] for r in sorted(joined))
        finally:
            if server is not None:
                server.close()

    def _kill_all(self) -> None:
        for b in self.ranks:
            b.kill()
        if self._release is not None:
            self._release()
            self._release = None

    # ---- the Backend protocol ------------------------------------------------------

    def info(self) -> EngineInfo:
        """Rank 0's facts, with the sequence slots of every rank and a line on the ranks."""
        infos = [b.info() for b in self.ranks]
        first = infos[0]
        line = (
            f"Data parallel: {self.num_ranks} engine processes (ranks) stepping on their own, "
            f"{first.max_num_seqs} sequences each: {'; '.join(b.describe() for b in self.ranks)}."
        )
        return replace(
            first,
            max_num_seqs=sum(i.max_num_seqs for i in infos),
            startup_log=[*first.startup_log, line],
        )

    def pids(self) -> list[int | None]:
        """Each rank's process id, in rank order (None for a rank on another host or in Ray)."""
        return [b.pid for b in self.ranks]

    def start(self, deliver: Callable[[object], None]) -> None:
        """Start relaying every rank's messages to ``deliver`` on the calling event loop."""
        self._deliver = deliver
        self._aio = asyncio.get_running_loop()
        for r, b in enumerate(self.ranks):
            b.start(functools.partial(self._on_message, r))

    def send(self, cmd: Command) -> None:
        """Route a command to its rank (or every rank); safe from any thread."""
        if isinstance(cmd, Add):
            self._send_add(cmd)
        elif isinstance(cmd, (Abort, EndInput)):
            with self._lock:
                rank = self._owner.get(cmd.request_id)
            if rank is not None:
                self.ranks[rank].send(cmd)
        elif isinstance(cmd, Query):
            ranks = range(self.num_ranks) if cmd.rank is None else [cmd.rank]
            with self._lock:
                self._gathers[cmd.token] = _Gather(set(ranks), last=cmd.last)
            for r in ranks:
                self.ranks[r].send(cmd)
        elif isinstance(cmd, LoRAOp):
            with self._lock:
                self._gathers[cmd.token] = _Gather(set(range(self.num_ranks)))
            for b in self.ranks:
                b.send(cmd)
        else:
            if isinstance(cmd, Stop):
                self._stopping = True
            for b in self.ranks:
                b.send(cmd)

    def _send_add(self, cmd: Add) -> None:
        with self._lock:
            rank = self._owner.get(cmd.request_id) if cmd.continues else None
            if rank is None:
                if cmd.continues:
                    # Its session already ended: any rank refuses it as such.
                    rank = 0
                else:
                    rank = self.router.route()
                    self._owner[cmd.request_id] = rank
                    self._unacked.add(cmd.request_id)
        self.ranks[rank].send(cmd)

    async def stop(self) -> None:
        """Stop every rank (each killed if it does not stop in time)."""
        self._stopping = True
        if self._publish is not None:
            self._publish.cancel()
        await asyncio.gather(*(b.stop() for b in self.ranks))
        if self._release is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._release)
            self._release = None

    # ---- messages from the ranks (event loop) -------------------------------------------

    def _on_message(self, rank: int, msg: object) -> None:
        if isinstance(msg, StepBatch):
            self._on_batch(rank, msg)
        elif isinstance(msg, Acks):
            with self._lock:
                for rid, err in msg.items:
                    if rid in self._unacked:
                        self._unacked.discard(rid)
                        if err is not None:
                            self._ended(rid)
        elif isinstance(msg, Failed):
            with self._lock:
                for rid in msg.request_ids:
                    self._ended(rid)
        elif isinstance(msg, (Reply, LoRAReply)):
            self._on_answer(rank, msg)
            return
        elif isinstance(msg, Dead):
            self._on_dead(rank, msg)
            return
        self._emit(msg)

    def _on_batch(self, rank: int, batch: StepBatch) -> None:
        batch.rank = rank
        snap = batch.snapshot
        if snap is not None:
            batch.snapshot = snap = replace(snap, engine=rank)
            self._counts[rank] = (snap.num_waiting, snap.num_running, snap.kv_usage)
            self._schedule_publish()
        with self._lock:
            for out in batch.outputs:
                if out.finished:
                    self._ended(out.request_id)

    def _ended(self, request_id: str) -> None:
        """A request left its rank (lock held)."""
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self.router.finished(rank)
            self._unacked.discard(request_id)

    def _schedule_publish(self) -> None:
        """Hand the router the ranks' queue sizes, at most every SNAPSHOT_INTERVAL_S (as vLLM does)."""
        if self._publish is not None or self._aio is None:
            return
        wait = self._last_publish + SNAPSHOT_INTERVAL_S - self._aio.time()
        if wait <= 0:
            self._publish_counts()
        else:
            self._publish = self._aio.call_later(wait, self._publish_counts)

    def _publish_counts(self) -> None:
        self._publish = None
        assert self._aio is not None
        self._last_publish = self._aio.time()
        with self._lock:
            self.router.snapshot(list(self._counts))

    def _on_answer(self, rank: int, msg: Reply | LoRAReply) -> None:
        with self._lock:
            g = self._gathers.get(msg.token)
            if g is None or rank not in g.ranks:
                return
            g.ranks.discard(rank)
            if isinstance(msg, Reply):
                g.steps.extend({"rank": rank, **s} for s in msg.steps)
            elif g.error is None:
                g.error = None if msg.error is None else f"data-parallel rank {rank}: {msg.error}"
            if g.ranks:
                return
            del self._gathers[msg.token]
        if isinstance(msg, Reply):
            steps = sorted(g.steps, key=lambda s: (s.get("time", 0.0), s["rank"]))[-g.last :]
            self._emit(Reply(msg.token, steps))
        else:
            self._emit(LoRAReply(msg.token, g.error))

    def _on_dead(self, rank: int, msg: Dead) -> None:
        if self._stopping or self.failure is not None:
            # A shutdown (every rank says so) or the aftermath of a failure: say it once.
            if not self._dead_sent:
                self._dead_sent = True
                self._emit(msg)
            return
        how = self.ranks[rank].describe_end(msg.message)
        self.failure = (
            f"data-parallel rank {rank} {how}; the server stops serving, as "
            "vLLM's does when an engine core dies: restart it"
        )
        with self._lock:
            survivors = [(rid, r) for rid, r in self._owner.items() if r != rank]
            self._owner.clear()
            self._unacked.clear()
            # Their callers get the Dead below.
            self._gathers.clear()
        # Their requests end with the error below; abort them so the survivors free their blocks.
        for rid, r in survivors:
            self.ranks[r].send(Abort(rid))
        self._dead_sent = True
        self._emit(Dead(self.failure))

    def _emit(self, msg: object) -> None:
        if self._deliver is not None:
            self._deliver(msg)


__all__ = ["DataParallelBackend", "threads_per_rank"]
