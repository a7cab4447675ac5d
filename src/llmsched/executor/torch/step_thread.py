"""The executor's own thread: its torch calls in submission order, and steps run back to back.

Steps are prepared on the engine's thread (their Request values read at
schedule time) and queued here. When another step is already queued, a
step's output is handed back only as that step's forward starts: the engine
wakes on the output and runs Python for a while, holding the GIL, and the
next forward should be under way by then rather than wait for it.

A step whose inputs depend on the outputs of the step before (speculative
decoding: its drafts and true positions) is queued as a preparation
instead, run here right after that step: no hand-off to the engine's thread
and back between the two forwards.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any

import torch

from llmsched.core.output import ModelRunnerOutput
from llmsched.executor.torch.input_batch import StepInputs

RunStep = Callable[[StepInputs, torch.Tensor], ModelRunnerOutput]


@dataclass(slots=True)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future


@dataclass(slots=True)
class _Step:
    step: StepInputs
    future: Future


@dataclass(slots=True)
class _Deferred:
    # Builds the step on this thread: its inputs, or its whole output when nothing runs.
    prepare: Callable[[], StepInputs | ModelRunnerOutput]
    future: Future


class StepThread:
    """One daemon thread that runs calls and steps in the order they were submitted.

    It keeps nothing of what it ran once it waits for more: an owner whose
    ``run_step`` holds it weakly can be garbage collected, and ``stop()``
    from its finalizer. Threads still running when the interpreter exits are
    stopped (after what is queued) and joined first: a thread taking the GIL
    back from a torch op during finalization is ended there, and unwinding
    torch's C++ frames aborts the process.
    """

    def __init__(self, run_step: RunStep, device: torch.device, name: str = "llmsched-executor") -> None:
        self._run_step = run_step
        self._device = device
        self._queue: SimpleQueue[_Call | _Step | _Deferred | None] = SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _running.add(self)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the thread after everything queued; wait and return (or raise) its result."""
        future: Future = Future()
        self._queue.put(_Call(fn, args, future))
        return future.result()

    def submit(self, step: StepInputs) -> Future[ModelRunnerOutput]:
        """Queue a step; its future completes with its output."""
        future: Future[ModelRunnerOutput] = Future()
        self._queue.put(_Step(step, future))
        return future

    def submit_deferred(
        self, prepare: Callable[[], StepInputs | ModelRunnerOutput]
    ) -> Future[ModelRunnerOutput]:
        """Queue a step to prepare here once everything before it ran; its future gets its output."""
        future: Future[ModelRunnerOutput] = Future()
        self._queue.put(_Deferred(prepare, future))
        return future

    def stop(self) -> None:
        """Let the thread end once it ran what is queued; returns at once (safe in a finalizer)."""
        self._queue.put(None)

    def close(self) -> None:
        """Finish what is queued, then stop the thread (and wait for it, unless called on it)."""
        self.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _loop(self) -> None:
        queue = self._queue
        # A step's output held back until the next step's forward starts.
        held: tuple[Future, ModelRunnerOutput] | None = None
        try:
            item = queue.get()
            while item is not None:
                # Each item is handled in a frame of its own, so that nothing
                # it holds (its owner, through a call or a preparation) stays
                # referenced while this thread waits for the next one.
                item, held = self._handle(item, held)
                if item is _WAIT:
                    item = queue.get()
        finally:
            _running.discard(self)

    def _handle(
        self, item: _Call | _Step | _Deferred, held: tuple[Future, ModelRunnerOutput] | None
    ) -> tuple[Any, tuple[Future, ModelRunnerOutput] | None]:
        """Run one queued item; the next item if it was taken already (else _WAIT), and the output held."""
        if isinstance(item, _Call):
            _settle(item.future, item.fn, *item.args)
            return _WAIT, held
        if isinstance(item, _Deferred):
            prepared = _prepare(item)
            if prepared is None:
                if held is not None:
                    held[0].set_result(held[1])
                return _WAIT, None
            item = prepared
        step, future = item.step, item.future
        try:
            input_ids = step.input_ids(self._device)
        except BaseException as e:
            future.set_exception(e)
            return _WAIT, None
        finally:
            if held is not None:
                # Now: the engine wakes on it and runs Python for a
                # while, holding the GIL, once this forward is under way.
                held[0].set_result(held[1])
        try:
            output = self._run_step(step, input_ids)
        except BaseException as e:
            future.set_exception(e)
            return _WAIT, None
        del input_ids
        try:
            following = self._queue.get_nowait()
        except Empty:
            future.set_result(output)
            return _WAIT, None
        if isinstance(following, (_Step, _Deferred)):
            # The next step's holes are this step's samples, just taken.
            return following, (future, output)
        future.set_result(output)
        return following, None


# What _handle returns when the next item is still to be waited for.
_WAIT = object()
# Threads started and not ended yet (stopped and joined at exit).
_running: set[StepThread] = set()


@atexit.register
def _stop_at_exit() -> None:
    for thread in list(_running):
        thread.close()


def _prepare(item: _Deferred) -> _Step | None:
    """The deferred step ready to run, or None once its future is settled (nothing to run, or it failed)."""
    try:
        prepared = item.prepare()
    except BaseException as e:
        item.future.set_exception(e)
        return None
    if isinstance(prepared, ModelRunnerOutput):
        item.future.set_result(prepared)
        return None
    return _Step(prepared, item.future)


def _settle(future: Future, fn: Callable[..., Any], *args: Any) -> None:
    """Complete ``future`` with ``fn(*args)``, or with the exception it raised."""
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)
