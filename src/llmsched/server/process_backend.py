"""The engine loop in a process of its own (the default, as vLLM runs its engine core).

The engine process loads the model and runs the EngineLoop; a pipe carries
commands in and step batches out. The HTTP process never holds the engine
process's interpreter lock, so however many clients stream, their JSON and
socket work does not lengthen a step. The engine process ignores Ctrl-C (the
server stops it with a Stop command) and exits when the pipe closes, so it
never outlives the server.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.dp.proc_transport import describe_exit
from llmsched.server.engine_loop import Command
from llmsched.server.engine_messages import (
    BATCH_TAG,
    Dead,
    EngineInfo,
    StepBatch,
    Stop,
    decode_batch,
    encode_batch,
)
from llmsched.server.prefault import prefault_kv_cache

log = logging.getLogger("llmsched.server")

STOP_TIMEOUT_S = 30.0


def engine_process_main(
    conn: Connection,
    engine_args: EngineArgs,
    admission_window_ms: float,
    trace_steps: int,
    kv_metrics_sample: float = 0.0,
    prefault: bool = False,
) -> None:
    """Entry point of the engine process: build the engine, announce it, serve commands until Stop."""
    # The server process handles Ctrl-C and SIGTERM (a whole process group gets them) and
    # stops this one with Stop once it has drained; a lost pipe ends it otherwise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_engine(conn, engine_args, admission_window_ms, trace_steps, kv_metrics_sample, prefault)


def run_engine(
    conn: Connection,
    engine_args: EngineArgs,
    admission_window_ms: float,
    trace_steps: int,
    kv_metrics_sample: float = 0.0,
    prefault: bool = False,
) -> None:
    """Build the engine, announce it on ``conn`` and serve its commands until Stop or a lost connection."""
    from llmsched.engine.llm_engine import LLMEngine
    from llmsched.server.engine_loop import EngineLoop

    try:
        engine = LLMEngine(engine_args)
        if prefault:
            prefault_kv_cache(engine)
    except Exception as e:  # reported to the server, which refuses to start with the message
        conn.send(Dead(f"{type(e).__name__}: {e}"))
        return
    lock = threading.Lock()

    def emit(msg: object) -> None:
        data = encode_batch(msg) if isinstance(msg, StepBatch) else msg
        with lock:
            conn.send(data)

    loop = EngineLoop(
        engine,
        emit,
        admission_window_ms=admission_window_ms,
        trace_steps=trace_steps,
        kv_metrics_sample=kv_metrics_sample,
    )
    emit(loop.info())
    # The loop steps on a thread of its own, not the main thread: on CPU we
    # measured the same steps up to a third slower from the main thread (and
    # the in-process baseline of benchmarks/serving/server_overhead.py steps the same way).
    stepper = threading.Thread(target=loop.run, name="llmsched-engine-loop", daemon=True)
    stepper.start()
    try:
        while stepper.is_alive():
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                loop.submit(Stop())
                break
            loop.submit(cmd)
            if isinstance(cmd, Stop):
                break
        stepper.join()
    finally:
        engine.close()


class ProcessBackend:
    """Starts the engine process and relays messages between it and the event loop."""

    def __init__(
        self,
        engine_args: EngineArgs,
        *,
        admission_window_ms: float = 0.0,
        trace_steps: int = 256,
        kv_metrics_sample: float = 0.0,
        start_timeout_s: float = 600.0,
        prefault_kv_cache: bool = False,
        wait: bool = True,
        name: str = "llmsched-engine",
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=engine_process_main,
            args=(child, engine_args, admission_window_ms, trace_steps, kv_metrics_sample, prefault_kv_cache),
            name=name,
            daemon=True,
        )
        self.process.start()
        child.close()
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._info: EngineInfo | None = None
        if wait:
            self.wait_started(start_timeout_s)

    def wait_started(self, timeout_s: float) -> None:
        """Wait for the engine process to report its engine; ConfigError (process killed) if it does not."""
        msg: object = None
        try:
            if self._conn.poll(timeout_s):
                msg = self._conn.recv()
        except (EOFError, OSError):
            msg = None
        if not isinstance(msg, EngineInfo):
            self.kill()
            why = (
                msg.message
                if isinstance(msg, Dead)
                else f"the engine process exited ({self.process.exitcode})"
            )
            raise ConfigError(f"the engine did not start: {why}")
        self._info = msg

    def kill(self) -> None:
        """Kill the engine process at once (a failed start, or another rank's)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self.process.pid

    def describe(self) -> str:
        """The engine process, for messages."""
        return f"engine process {self.pid}"

    def describe_end(self, message: str) -> str:
        """How the engine process ended: its exit status, given a moment to show."""
        # A closed pipe comes with the process's end; its exit status may lag a little.
        self.process.join(0.2)
        code = self.process.exitcode
        how = describe_exit(code) if code is not None else f"stopped ({message})"
        return f"(engine process {self.pid}) {how}"

    def info(self) -> EngineInfo:
        """The engine's facts, as the engine process reported them."""
        assert self._info is not None, "wait_started() first"
        return self._info

    def start(self, deliver: Callable[[object], None]) -> None:
        """Start relaying the engine's messages to ``deliver`` on the calling event loop."""
        aio = asyncio.get_running_loop()
        conn = self._conn

        def read() -> None:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = Dead("the engine process exited")
                if isinstance(msg, tuple) and msg and msg[0] == BATCH_TAG:
                    msg = decode_batch(msg)
                try:
                    aio.call_soon_threadsafe(deliver, msg)
                except RuntimeError:
                    return  # the event loop closed
                if isinstance(msg, Dead):
                    return

        self._reader = threading.Thread(target=read, name="llmsched-engine-reader", daemon=True)
        self._reader.start()

    def send(self, cmd: Command) -> None:
        """Send a command to the engine process; safe from any thread."""
        try:
            with self._send_lock:
                self._conn.send(cmd)
        except (OSError, ValueError):
            log.warning("the engine process is gone; dropped %s", type(cmd).__name__)

    async def stop(self) -> None:
        """Stop the engine process (killing it if it does not stop in time)."""
        self.send(Stop())
        aio = asyncio.get_running_loop()
        await aio.run_in_executor(None, self.process.join, STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            await aio.run_in_executor(None, self.process.join, 5)
        if self._reader is not None:
            await aio.run_in_executor(None, self._reader.join, 5)
        self._conn.close()
