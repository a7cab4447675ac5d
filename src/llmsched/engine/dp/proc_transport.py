"""The real transport: one process per rank, synchronised with torch.distributed.

The front end listens on a TCP address (loopback by default) and each rank
process connects to it, so ranks can also be started by hand on other
machines (see ``worker``); the ranks meet each other through an env://
rendezvous (``master_addr:master_port``), gloo on CPU and nccl on CUDA.

Lock-step waves: ranks idle until the front end sends StartWave to all of
them (when a request arrives at an idle group), then step together until
their per-step all_gather says no rank has work. A request that reached its
rank just after that consensus is caught by the count of requests each
rank had received when the wave ended, and the front end starts the next
wave for it.

Faults, so that no rank waits forever and the engine fails loudly:

- each rank process is watched through its sentinel: a rank that exits
  (killed, crashed) is noticed at once, with its exit code or signal;
- a rank that hits an error sends Failed (with the traceback) before it
  exits; errors from the exchange are marked as such, since they are
  usually a symptom of another rank's failure, and the front end blames a
  rank that died or failed on its own first;
- every collective has a timeout (the process group's), so a rank stuck
  in an all_gather with a dead or hung peer fails instead of blocking;
- a watchdog in the front end fails the engine when a rank with work has
  not reported for ``stall_timeout_s``;
- on any failure every rank is told to stop and is terminated, then
  killed, if it does not exit within a few seconds; ranks also exit when
  the front end's connection or process disappears.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait
from typing import Protocol

from llmsched.core.request import Request
from llmsched.engine.dp.config import DPConfig
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
from llmsched.engine.dp.transport import DPRankError, RankReport
from llmsched.engine.dp.worker import AUTHKEY_ENV
from llmsched.engine.engine_core import EngineCore

# After a first failure, how long to wait for the other ranks' news before
# deciding which rank to blame (a killed rank's peers often report first).
_BLAME_GRACE_S = 1.0
# How long ranks get to exit after Shutdown, then after SIGTERM; after a
# failure the survivors may sit in a doomed collective, so they get less.
_EXIT_GRACE_S = 5.0
_TERM_GRACE_S = 2.0
_FAILED_EXIT_GRACE_S = 1.0
# The longest the front end blocks at once, so its watchdog keeps running.
_POLL_S = 0.5
# What a failure report says about its rank, most telling first.
_ERROR, _EXIT, _COLLECTIVE = 0, 1, 2


class EngineFactory(Protocol):
    """Builds one rank's engine inside the rank process (must be picklable)."""

    def __call__(self, rank: int, prefill_schedule_interval: int) -> EngineCore:
        """The EngineCore of ``rank``."""
        ...


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for the env:// rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class _Rank:
    """The front end's view of one rank."""

    rank: int
    conn: Connection | None = None
    process: RankProcess | None = None
    pid: int | None = None
    host: str = ""
    ready: Ready | None = None
    sent: int = 0
    # Requests that ended (finished, rejected or aborted) as far as the front end knows.
    ended: int = 0
    steps: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    exited: bool = False


def describe_exit(exitcode: int | None) -> str:
    """'killed by SIGKILL', 'exited with code 1', ..."""
    if exitcode is None:
        return "is gone"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


class RankProcess:
    """A local rank process with a waitable sentinel (a pidfd) and multiprocessing-like methods."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(cmd, env=env)
        self.pid = self.popen.pid
        # Readable once the process exits, so wait() notices a death at once.
        self.sentinel: int | None = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None

    @property
    def exitcode(self) -> int | None:
        """None while running; negative: killed by that signal."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the process to exit."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def terminate(self) -> None:
        """SIGTERM."""
        with contextlib.suppress(ProcessLookupError):
            self.popen.terminate()

    def kill(self) -> None:
        """SIGKILL."""
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def close(self) -> None:
        """Release the sentinel."""
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


class ProcessTransport:
    """Runs ``dp.data_parallel_size`` rank processes and talks to them.

    ``spawn_ranks``: the ranks started here (default all); the others are
    expected to connect on their own (``python -m llmsched.engine.dp.worker``
    with ``LLMSCHED_DP_AUTHKEY`` set to ``authkey.hex()``).
    """

    def __init__(
        self,
        engine_factory: EngineFactory,
        dp: DPConfig,
        *,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        master_addr: str | None = None,
        master_port: int | None = None,
        spawn_ranks: Sequence[int] | None = None,
        startup_timeout_s: float = 600.0,
        collective_timeout_s: float = 300.0,
        stall_timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        trace: bool = False,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        self.dp = dp
        self.num_ranks = n = dp.data_parallel_size
        self.lockstep = dp.lockstep
        self.collective_timeout_s = collective_timeout_s
        # A rank waiting in the exchange fails after the collective timeout;
        # the watchdog leaves it that long before blaming the quiet rank.
        self.stall_timeout_s = stall_timeout_s if stall_timeout_s is not None else collective_timeout_s + 30.0
        self.authkey = secrets.token_bytes(32)
        self._host = socket.gethostname()
        self._listener = Listener((host, 0), authkey=self.authkey)
        self.address: tuple[str, int] = self._listener.address  # type: ignore[assignment]
        self.master_addr = master_addr or host
        self.master_port = master_port or free_port(self.master_addr)
        self.ranks = [_Rank(r) for r in range(n)]
        self.wave = 0
        self.group_running = False
        self._done_in_wave: dict[int, int] = {}
        self._closed = False
        self._failure: DPRankError | None = None
        spawn = list(range(n)) if spawn_ranks is None else list(spawn_ranks)
        worker_env = dict(os.environ)
        worker_env.update(env or {})
        worker_env[AUTHKEY_ENV] = self.authkey.hex()
        if self.master_addr in ("127.0.0.1", "localhost"):
            # Loopback rendezvous: keep gloo's own connections on loopback too.
            worker_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        try:
            for r in spawn:
                # A fresh interpreter running the worker module, exactly as a
                # rank started by hand elsewhere would (no re-import of the
                # caller's main module, unlike multiprocessing's spawn).
                cmd = [
                    sys.executable,
                    "-m",
                    "llmsched.engine.dp.worker",
                    "--front-end",
                    f"{self.address[0]}:{self.address[1]}",
                    "--rank",
                    str(r),
                    "--parent-pid",
                    str(os.getpid()),
                ]
                proc = RankProcess(cmd, worker_env)
                self.ranks[r].process = proc
                self.ranks[r].pid = proc.pid
            remote = [r for r in range(n) if r not in spawn]
            if remote and announce is not None:
                host_port = f"{self.address[0]}:{self.address[1]}"
                announce(
                    f"waiting for ranks {remote}: on their machines run "
                    f"{AUTHKEY_ENV}={self.authkey.hex()} python -m llmsched.engine.dp.worker "
                    f"--front-end {host_port} --rank R"
                )
            self._handshake(
                Setup(
                    0,
                    dp,
                    engine_factory,
                    backend,
                    self.master_addr,
                    self.master_port,
                    collective_timeout_s,
                    trace,
                ),
                startup_timeout_s,
            )
        except BaseException:
            self._shutdown_processes()
            self._listener.close()
            raise

    # ---- start-up ----------------------------------------------------------------

    def _handshake(self, setup: Setup, timeout_s: float) -> None:
        """Accept every rank's connection, send its Setup, wait until all are Ready."""
        accepted: list[Connection] = []
        errors: list[BaseException] = []

        def accept() -> None:
            """Accept the ranks' connections (in a thread: accept() has no timeout)."""
            try:
                for _ in range(self.num_ranks):
                    accepted.append(self._listener.accept())
            except BaseException as e:  # the listener closed under us, or a bad key
                errors.append(e)

        th = threading.Thread(target=accept, daemon=True)
        th.start()
        deadline = time.monotonic() + timeout_s
        pending: list[Connection] = []
        ready = 0
        while ready < self.num_ranks:
            while accepted:
                pending.append(accepted.pop())
            if errors:
                raise DPRankError(-1, f"accepting rank connections failed: {errors[0]}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r.rank for r in self.ranks if r.ready is None]
                raise DPRankError(missing[0], f"ranks {missing} were not ready within {timeout_s:.0f} s")
            watch: list[object] = list(pending)
            watch += [r.conn for r in self.ranks if r.conn is not None and r.ready is None]
            watch += [
                r.process.sentinel
                for r in self.ranks
                if r.process is not None and r.process.sentinel is not None and r.ready is None
            ]
            for r in self.ranks:
                if r.ready is None and r.process is not None and not r.process.is_alive():
                    r.exited = True
                    raise self._startup_failure(r)
            for obj in wait(watch, timeout=min(remaining, 0.2)):
                if isinstance(obj, int):
                    r = next(x for x in self.ranks if x.process is not None and x.process.sentinel == obj)
                    r.exited = True
                    raise self._startup_failure(r)
                conn = obj
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    r = self._rank_of(conn)
                    if r is None:
                        pending.remove(conn)  # type: ignore[arg-type]
                        continue
                    raise self._startup_failure(r) from None
                if isinstance(msg, Hello):
                    if not 0 <= msg.rank < self.num_ranks or self.ranks[msg.rank].conn is not None:
                        raise DPRankError(msg.rank, f"unexpected rank {msg.rank} connected from {msg.host}")
                    pending.remove(conn)  # type: ignore[arg-type]
                    r = self.ranks[msg.rank]
                    r.conn, r.pid, r.host = conn, msg.pid, msg.host  # type: ignore[assignment]
                    setup.rank = msg.rank
                    conn.send(setup)
                elif isinstance(msg, Ready):
                    self.ranks[msg.rank].ready = msg
                    self.ranks[msg.rank].last_seen = time.monotonic()
                    ready += 1
                elif isinstance(msg, Failed):
                    raise DPRankError(msg.rank, f"failed to start: {msg.reason}\n{msg.traceback}")
                else:
                    raise DPRankError(-1, f"unexpected {type(msg).__name__} during start-up")

    def _startup_failure(self, r: _Rank) -> DPRankError:
        # A rank that failed usually said why before exiting.
        if r.conn is not None:
            with contextlib.suppress(EOFError, OSError):
                while r.conn.poll(0.2):
                    msg = r.conn.recv()
                    if isinstance(msg, Failed):
                        return DPRankError(r.rank, f"failed to start: {msg.reason}\n{msg.traceback}")
        code = r.process.exitcode if r.process is not None else None
        return DPRankError(r.rank, f"process {r.pid} {describe_exit(code)} while starting")

    def _rank_of(self, conn: object) -> _Rank | None:
        return next((r for r in self.ranks if r.conn is conn), None)

    # ---- requests ----------------------------------------------------------------

    def add_request(self, rank: int, request: Request) -> None:
        """Send a request to ``rank``; an idle lock-step group is started for it."""
        self._check()
        r = self.ranks[rank]
        if r.sent == r.ended:
            # An idle rank's silence so far was not a stall.
            r.last_seen = time.monotonic()
        self._send(r, AddRequest(request))
        r.sent += 1
        if self.lockstep and not self.group_running:
            self._start_wave()

    def abort_requests(self, rank: int, request_ids: Sequence[str]) -> None:
        """Abort on ``rank``."""
        self._check()
        r = self.ranks[rank]
        self._send(r, Abort(list(request_ids)))
        r.ended += len(request_ids)

    def has_work(self) -> bool:
        """True while a wave runs (lock-step) or any rank holds requests it was sent."""
        return self.group_running or any(r.sent > r.ended for r in self.ranks)

    def _start_wave(self) -> None:
        now = time.monotonic()
        for r in self.ranks:
            r.last_seen = now
            self._send(r, StartWave(self.wave))
        self.group_running = True

    def _send(self, r: _Rank, msg: object) -> None:
        assert r.conn is not None
        try:
            r.conn.send(msg)
        except (OSError, EOFError) as e:
            raise self._fail_now(r.rank, f"connection lost while sending ({e})") from None

    # ---- progress ----------------------------------------------------------------

    def step(self, timeout: float | None = None) -> list[RankReport]:
        """Reports that arrive before ``timeout`` (None: wait for at least one); DPRankError on failure."""
        self._check()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            reports = self._collect(left)
            # Checked every time: a busy rank's reports must not hide a silent one.
            self._watchdog()
            if reports:
                return reports
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def _collect(self, timeout: float) -> list[RankReport]:
        conns = {r.conn: r for r in self.ranks if r.conn is not None and not r.exited}
        sentinels = {
            r.process.sentinel: r
            for r in self.ranks
            if r.process is not None and r.process.sentinel is not None and not r.exited
        }
        reports: list[RankReport] = []
        failures: list[tuple[_Rank, str, int]] = []
        for r in self.ranks:
            # Without pidfds there is no sentinel to wait on: look instead.
            if (
                r.process is not None
                and r.process.sentinel is None
                and not r.exited
                and not r.process.is_alive()
            ):
                self._drain_dying(r, reports, failures)
                r.exited = True
                failures.append((r, f"its process {r.pid} {describe_exit(r.process.exitcode)}", _EXIT))
        for obj in wait([*conns, *sentinels], timeout=timeout):
            if obj in sentinels:
                r = sentinels[obj]
                self._drain_dying(r, reports, failures)
                r.exited = True
                failures.append((r, f"its process {r.pid} {describe_exit(r.process.exitcode)}", _EXIT))
                continue
            r = conns[obj]
            try:
                while r.conn.poll(0):
                    self._handle(r, r.conn.recv(), reports, failures)
            except (EOFError, OSError):
                self._await_exit(r)
                failures.append((r, self._lost(r), _EXIT))
                r.exited = True
        if failures:
            raise self._blame(failures)
        return reports

    def _handle(self, r: _Rank, msg: object, reports: list[RankReport], failures: list) -> None:
        now = time.monotonic()
        r.last_seen = now
        if isinstance(msg, StepReport):
            if msg.step >= 0:
                r.steps = msg.step
            for out in msg.outputs:
                if out.finish_reason is not None:
                    r.ended += 1
            reports.append(
                RankReport(
                    rank=msg.rank,
                    outputs=msg.outputs,
                    num_running=msg.num_running,
                    num_waiting=msg.num_waiting,
                    num_received=msg.num_received,
                    num_preemptions=msg.num_preemptions,
                    # Same host, same monotonic clock: the step's own end is
                    # exact, where arrival would bunch reports read together.
                    time=msg.time if r.host == self._host and msg.time else now,
                    executed=msg.executed,
                )
            )
            if msg.wave_done:
                self._wave_done(msg)
        elif isinstance(msg, Failed):
            detail = f"{msg.reason}\n{msg.traceback}" if msg.traceback else msg.reason
            failures.append((r, detail, _COLLECTIVE if msg.collective else _ERROR))
        else:
            failures.append((r, f"sent an unexpected {type(msg).__name__}", _ERROR))

    def _wave_done(self, msg: StepReport) -> None:
        """All ranks end a wave at the same step; once all said so, start another if requests are owed."""
        self._done_in_wave[msg.rank] = msg.num_received
        if len(self._done_in_wave) < self.num_ranks:
            return
        unseen = any(self.ranks[r].sent > received for r, received in self._done_in_wave.items())
        self._done_in_wave.clear()
        self.wave = msg.wave + 1
        self.group_running = False
        if unseen:
            self._start_wave()

    def _drain_dying(self, r: _Rank, reports: list[RankReport], failures: list) -> None:
        """Read what a rank sent before it exited (its Failed message says why)."""
        if r.conn is None:
            return
        with contextlib.suppress(EOFError, OSError):
            while r.conn.poll(0):
                self._handle(r, r.conn.recv(), reports, failures)

    def _await_exit(self, r: _Rank) -> None:
        """A closed connection usually means the process is exiting: give it a moment."""
        if r.process is not None:
            r.process.join(0.5)

    def _lost(self, r: _Rank) -> str:
        """Why a rank's connection closed, as far as can be told."""
        if r.process is not None and r.process.exitcode is not None:
            return f"its process {r.pid} {describe_exit(r.process.exitcode)}"
        return f"its connection to the front end closed (process {r.pid} on {r.host or 'an unknown host'})"

    def _blame(self, failures: list[tuple[_Rank, str, int]]) -> DPRankError:
        """Wait briefly for more news, then name the rank most likely at the root of it.

        A killed rank's peers often report a failed exchange before its own
        death is noticed, so: a rank's own error first, then a rank that
        died without saying why, then a lost connection, then an error in
        the exchange (a symptom of someone else's failure).
        """
        # A rank's own error or death is first-hand; only exchange errors,
        # which are symptoms, are worth waiting for better news.
        grace = _BLAME_GRACE_S if all(kind == _COLLECTIVE for _, _, kind in failures) else 0.0
        deadline = time.monotonic() + grace
        while True:
            for r in self.ranks:
                if r.exited or r.process is None or r.process.is_alive():
                    continue
                self._drain_dying(r, [], failures)
                r.exited = True
                failures.append((r, f"its process {r.pid} {describe_exit(r.process.exitcode)}", _EXIT))
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        kinds: dict[int, dict[int, str]] = {}
        for r, why, kind in failures:
            kinds.setdefault(r.rank, {}).setdefault(kind, why)
        if all(_COLLECTIVE in k and _ERROR not in k for k in kinds.values()):
            # Only failed exchanges: the rank they waited for is the one that
            # is still alive and said nothing.
            silent = [r for r in self.ranks if r.rank not in kinds and not r.exited]
            if silent:
                r = min(silent, key=lambda x: (x.steps, x.last_seen))
                waited = min(kinds)
                return self._fail_now(
                    r.rank,
                    f"stopped responding: rank {waited} timed out waiting for it in the per-step exchange "
                    f"(collective timeout {self.collective_timeout_s:g} s); its last report was step "
                    f"{r.steps}, {time.monotonic() - r.last_seen:.1f} s ago",
                )
        for kind in (_ERROR, _EXIT, _COLLECTIVE):
            for rank in sorted(kinds):
                k = kinds[rank]
                if kind in k and (kind != _EXIT or (_ERROR not in k and _COLLECTIVE not in k)):
                    why = k[kind]
                    if kind == _ERROR and _EXIT in k:
                        why = f"{why}\n({k[_EXIT].removeprefix('its ')})"
                    return self._fail_now(rank, why)
        r, why, _ = failures[0]
        return self._fail_now(r.rank, why)

    def _watchdog(self) -> None:
        """Fail when a rank with work has not reported for stall_timeout_s."""
        now = time.monotonic()
        if self.lockstep:
            busy = self.ranks if self.group_running else []
        else:
            busy = [r for r in self.ranks if r.sent > r.ended]
        quiet = [r for r in busy if now - r.last_seen > self.stall_timeout_s]
        if not quiet:
            return
        r = min(quiet, key=lambda x: (x.steps, x.last_seen))
        others = max((x.steps for x in self.ranks if x is not r), default=r.steps)
        raise self._fail_now(
            r.rank,
            f"no report for {now - r.last_seen:.0f} s (stall timeout {self.stall_timeout_s:.0f} s) while it "
            f"had work; it is at step {r.steps}, the furthest other rank at step {others}",
        )

    def _fail_now(self, rank: int, reason: str) -> DPRankError:
        err = DPRankError(rank, reason)
        self._failure = err
        self._shutdown_processes(_FAILED_EXIT_GRACE_S, terminate=False)
        return err

    def _check(self) -> None:
        if self._failure is not None:
            raise DPRankError(self._failure.rank, self._failure.reason)
        if self._closed:
            raise RuntimeError("the transport is closed")

    # ---- shutdown ----------------------------------------------------------------

    def _shutdown_processes(self, grace_s: float = _EXIT_GRACE_S, terminate: bool = True) -> None:
        for r in self.ranks:
            if r.conn is not None:
                with contextlib.suppress(OSError, EOFError):
                    r.conn.send(Shutdown())
        deadline = time.monotonic() + grace_s
        procs = [r.process for r in self.ranks if r.process is not None]
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if terminate:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        deadline = time.monotonic() + (_TERM_GRACE_S if terminate else 0.0)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for r in self.ranks:
            if r.conn is not None:
                with contextlib.suppress(OSError):
                    r.conn.close()
            if r.process is not None:
                r.process.close()
            r.exited = True

    def pids(self) -> list[int | None]:
        """Each rank's process id."""
        return [r.pid for r in self.ranks]

    def close(self) -> None:
        """Stop every rank (Shutdown, then SIGTERM, then SIGKILL) and close the listener."""
        if self._closed:
            return
        self._closed = True
        self._shutdown_processes()
        self._listener.close()


__all__ = ["AUTHKEY_ENV", "EngineFactory", "ProcessTransport", "describe_exit", "free_port"]
