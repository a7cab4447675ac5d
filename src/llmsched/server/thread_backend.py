"""The engine loop on a thread of the server process (``--engine-mode thread``).

Cheap to start and lets tests plug in any executor, but the loop shares the
interpreter lock with the HTTP side: under many streaming clients, HTTP
work lengthens steps. The process backend is the default for serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from llmsched.engine.llm_engine import LLMEngine
from llmsched.server.engine_loop import Command, EngineLoop
from llmsched.server.engine_messages import EngineInfo, Stop


class ThreadBackend:
    """Runs an EngineLoop over ``engine`` on a background thread."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        admission_window_ms: float = 0.0,
        trace_steps: int = 256,
        kv_metrics_sample: float = 0.0,
    ) -> None:
        self.engine = engine
        self.loop = EngineLoop(
            engine,
            self._drop,
            admission_window_ms=admission_window_ms,
            trace_steps=trace_steps,
            kv_metrics_sample=kv_metrics_sample,
        )
        self._thread: threading.Thread | None = None

    @staticmethod
    def _drop(_: object) -> None:
        return None

    def info(self) -> EngineInfo:
        """The engine's facts."""
        return self.loop.info()

    def start(self, deliver: Callable[[object], None]) -> None:
        """Start the thread; messages reach ``deliver`` on the calling event loop."""
        aio = asyncio.get_running_loop()

        def emit(msg: object) -> None:
            # RuntimeError: the event loop closed, the server is going away.
            with contextlib.suppress(RuntimeError):
                aio.call_soon_threadsafe(deliver, msg)

        self.loop.emit = emit
        self._thread = threading.Thread(target=self.loop.run, name="llmsched-engine", daemon=True)
        self._thread.start()

    def send(self, cmd: Command) -> None:
        """Queue a command; safe from any thread."""
        self.loop.submit(cmd)

    async def stop(self) -> None:
        """Stop the loop, wait for the thread, close the engine."""
        self.loop.submit(Stop())
        t = self._thread
        if t is not None:
            await asyncio.get_running_loop().run_in_executor(None, t.join)
        self.engine.close()
