"""A real rank: one process that owns a scheduler, KV cache and executor, and steps with its peers.

Started by the ProcessTransport (or by hand on another machine:
``LLMSCHED_DP_AUTHKEY=... python -m llmsched.engine.dp.worker --front-end HOST:PORT --rank R``),
it connects to the front end, receives its Setup, builds its engine, joins
the torch.distributed group (lock-step only) and loops:

- lock-step: idle until the front end starts a wave; then every iteration
  drains the inbox, runs one step (a dummy one when nothing is scheduled),
  all-gathers (running, waiting, unfinished) with the other ranks and
  reports; when the exchange says no rank has work, the wave ends on every
  rank at the same step.
- independent: steps whenever it has requests, no collectives.

Any error is sent to the front end as Failed (naming whether it came from
the exchange, i.e. most likely another rank's failure) before the process
exits non-zero. A lost front end (closed connection, or the parent process
gone) makes the rank exit too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection

from llmsched.core.errors import RequestRejected
from llmsched.engine.dp.collective import CollectiveError, TorchGroup
from llmsched.engine.dp.messages import (
    Abort,
    AddRequest,
    Failed,
    Hello,
    Ready,
    Setup,
    Shutdown,
    StartWave,
    StepReport,
)
from llmsched.engine.dp.policies import PrefillCadence
from llmsched.engine.dp.rank import DPRank
from llmsched.engine.dp.transport import TokenOutput
from llmsched.engine.engine_core import EngineStep

AUTHKEY_ENV = "LLMSCHED_DP_AUTHKEY"
# How often a spawned rank checks that the process that started it is alive.
_PARENT_POLL_S = 0.5


class _Stop(Exception):
    """The front end asked this rank to leave."""


class RankWorker:
    """The loop of one rank process."""

    def __init__(self, conn: Connection, setup: Setup) -> None:
        self.conn = conn
        self.setup = setup
        self.dp = setup.dp
        self.rank_id = setup.rank
        self.rank: DPRank | None = None
        self.group: TorchGroup | None = None
        self.cadence = PrefillCadence(self.dp.prefill_schedule_interval if self.dp.lockstep else 1)
        self.wave = 0
        self.running = False
        self._since_sync = 0

    # ---- set-up --------------------------------------------------------------------

    def start(self) -> None:
        """Build the engine, join the group, tell the front end."""
        s = self.setup
        engine = s.engine_factory(s.rank, self.dp.rank_prefill_interval)
        self.rank = DPRank(s.rank, engine, self.dp)
        if s.trace:
            self.rank.scheduler.enable_trace()
        if self.dp.lockstep and self.dp.data_parallel_size > 1:
            self.group = TorchGroup(
                s.rank,
                self.dp.data_parallel_size,
                backend=s.backend,
                master_addr=s.master_addr,
                master_port=s.master_port,
                timeout_s=s.collective_timeout_s,
                device=_group_device(s.backend, engine),
            )
        cfg = engine.config
        self.conn.send(Ready(s.rank, cfg.num_gpu_blocks, cfg.max_model_len, cfg.max_num_seqs))

    # ---- the loop --------------------------------------------------------------------

    def run(self) -> None:
        """Serve until Shutdown; raises on errors (the caller reports them)."""
        try:
            if self.dp.lockstep:
                self._lockstep_loop()
            else:
                self._independent_loop()
        except _Stop:
            return

    def _lockstep_loop(self) -> None:
        rank = self.rank
        assert rank is not None
        while True:
            if not self.running:
                self._handle(self.conn.recv())
                continue
            self._drain()
            es = rank.step(self.cadence.throttle())
            group_running = self._exchange()
            self.cadence.advance(group_running)
            self._report(es, wave_done=not group_running)
            if not group_running:
                self.wave += 1
                self.running = False

    def _independent_loop(self) -> None:
        rank = self.rank
        assert rank is not None
        while True:
            if not rank.has_requests():
                self._handle(self.conn.recv())
                continue
            self._drain()
            if not rank.has_requests():
                continue
            self._report(rank.step(False), wave_done=False)

    def _exchange(self) -> bool:
        """All-gather statuses on sync steps; True while any rank has work."""
        rank = self.rank
        assert rank is not None
        self._since_sync += 1
        if self.group is None:
            return rank.status().unfinished
        if self._since_sync < self.dp.sync_interval:
            return True
        self._since_sync = 0
        statuses = self.group.all_gather(rank.status())
        rank.observe(statuses)
        return any(s.unfinished for s in statuses)

    def _report(self, es: EngineStep | None, wave_done: bool) -> None:
        rank = self.rank
        assert rank is not None
        st = rank.status()
        self.conn.send(
            StepReport(
                rank=self.rank_id,
                step=rank.num_steps,
                outputs=rank.token_outputs(es),
                num_running=st.running,
                num_waiting=st.waiting,
                num_received=rank.num_received,
                num_preemptions=rank.scheduler.num_preemptions,
                executed=rank.executed,
                wave=self.wave,
                wave_done=wave_done,
                time=time.monotonic(),
            )
        )

    def _drain(self) -> None:
        conn = self.conn
        while conn.poll(0):
            self._handle(conn.recv())

    def _handle(self, msg: object) -> None:
        rank = self.rank
        assert rank is not None
        if isinstance(msg, AddRequest):
            try:
                rank.add_request(msg.request)
            except RequestRejected as e:
                out = TokenOutput(msg.request.request_id, [], "error", error=str(e))
                running, waiting = rank.scheduler.get_request_counts()
                # Not a step (step -1): the rejection goes back at once, since
                # an idle rank may not step again for a long time.
                self.conn.send(
                    StepReport(
                        self.rank_id,
                        -1,
                        [out],
                        num_running=running,
                        num_waiting=waiting,
                        num_received=rank.num_received,
                        wave=self.wave,
                    )
                )
        elif isinstance(msg, Abort):
            rank.abort(msg.request_ids)
        elif isinstance(msg, StartWave):
            # A start for a wave that already ended is stale: the front end
            # sends one per wave, after learning the previous one ended.
            if msg.wave == self.wave:
                self.running = True
        elif isinstance(msg, Shutdown):
            raise _Stop
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")

    def close(self) -> None:
        """Leave the group and release the executor."""
        if self.group is not None:
            self.group.close()
        if self.rank is not None:
            self.rank.close()


def _group_device(backend: str, engine: object) -> str:
    """Where the exchange's tensors live: the executor's CUDA device under nccl, else CPU."""
    if backend != "nccl":
        return "cpu"
    device = getattr(engine.executor, "device", None)  # type: ignore[attr-defined]
    return str(device) if device is not None and str(device).startswith("cuda") else "cuda"


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that spawned this rank is gone (it can no longer stop us)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(3)


def rank_process_main(host: str, port: int, rank: int, authkey: bytes, parent_pid: int | None = None) -> None:
    """Entry point of a rank process: connect, set up, serve, report any failure, exit."""
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    conn = Client((host, port), authkey=authkey)
    conn.send(Hello(rank, os.getpid(), socket.gethostname()))
    worker: RankWorker | None = None
    code = 0
    try:
        setup = conn.recv()
        if not isinstance(setup, Setup):
            raise TypeError(f"expected Setup, got {type(setup).__name__}")
        worker = RankWorker(conn, setup)
        worker.start()
        worker.run()
    except (EOFError, ConnectionError, BrokenPipeError):
        # The front end is gone: nobody is left to serve or to tell.
        code = 4
    except BaseException as e:
        code = 1
        collective = isinstance(e, CollectiveError)
        # The front end may be gone too; the exit code still tells.
        with contextlib.suppress(Exception):
            conn.send(Failed(rank, f"{type(e).__name__}: {e}", traceback.format_exc(), collective))
    else:
        if worker is not None:
            worker.close()
    finally:
        with contextlib.suppress(Exception):
            conn.close()
    # A failed rank skips interpreter teardown: a broken process group's
    # destructors can block, and there is nothing left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """``python -m llmsched.engine.dp.worker``: start one rank by hand (e.g. on another machine)."""
    ap = argparse.ArgumentParser(description="Run one data-parallel rank of an llmsched engine.")
    ap.add_argument("--front-end", required=True, metavar="HOST:PORT", help="the front end's rank listener")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = ap.parse_args(argv)
    key = os.environ.get(AUTHKEY_ENV)
    if not key:
        ap.error(f"set {AUTHKEY_ENV} to the front end's key (it prints it when it waits for remote ranks)")
    host, _, port = args.front_end.rpartition(":")
    rank_process_main(host, int(port), args.rank, bytes.fromhex(key), args.parent_pid)


if __name__ == "__main__":
    main()
