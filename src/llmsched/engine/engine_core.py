"""The engine loop: schedule, execute, update; with async scheduling, one step kept in flight."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from llmsched.core.config import SchedulerConfig
from llmsched.core.connector import KVConnector
from llmsched.core.errors import RequestRejected
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput, StepOutputs
from llmsched.core.policy import Policy
from llmsched.core.request import Request, RequestStatus
from llmsched.core.scheduler import Scheduler
from llmsched.executor.protocol import Executor, submit_step

_EMPTY_RESULT = ModelRunnerOutput(sampled_token_ids=())
# Steps scheduled but not yet updated, at most (vLLM's batch queue size with
# async scheduling): the one running and the one planned behind it.
BATCH_QUEUE_SIZE = 2


@dataclass(slots=True)
class EngineStep:
    """One step's batch, its outcome, and what it cost."""

    scheduler_output: SchedulerOutput
    model_output: ModelRunnerOutput
    outputs: StepOutputs
    # Queue sizes and KV usage right after schedule().
    num_running: int
    num_waiting: int
    kv_usage: float
    schedule_ns: int
    # Sync: the executor's run. Async: the time spent waiting for the result
    # (the model ran meanwhile).
    execute_ns: int
    update_ns: int
    # time.monotonic() when the step was scheduled (async: an earlier call).
    schedule_time: float = 0.0


@dataclass(slots=True)
class _InFlight:
    """A scheduled step whose output has not been applied yet."""

    so: SchedulerOutput
    # None: not handed to the executor yet (sync mode runs it at update).
    result: ModelRunnerOutput | Future[ModelRunnerOutput] | None
    num_running: int
    num_waiting: int
    kv_usage: float
    schedule_ns: int
    schedule_time: float


class EngineCore:
    """Couples a Scheduler to an Executor; contains no scheduling logic itself.

    With ``config.async_scheduling`` the engine drives the scheduler as vLLM's
    ``step_with_batch_queue`` does: each ``step()`` schedules a new batch and
    hands it to the executor before the previous batch's output is applied,
    so the executor (when it runs asynchronously) always has the next step
    queued, and the host work of one step overlaps the model time of the
    other. ``step()`` then returns the step it updated, or None on a call
    that only filled the queue.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        policy: Policy | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.scheduler = Scheduler(config, policy, connector)
        # With a KV connector every step reaches the executor, even an empty
        # one: its worker side reports transfers that end meanwhile.
        self._skip_empty_steps = connector is None
        self.executor = executor
        self.async_scheduling = config.async_scheduling
        self._in_flight: deque[_InFlight] = deque()
        # The batch the last step() call scheduled (None: it scheduled none,
        # only applied a step in flight). With async scheduling it is not the
        # step that call returned.
        self.last_scheduled: SchedulerOutput | None = None

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestRejected (nothing else changes) if invalid."""
        self.scheduler.add_request(request)

    def add_requests(self, requests: Iterable[Request]) -> list[tuple[Request, RequestRejected]]:
        """Queue many requests; the invalid ones are returned with their errors, the rest queued."""
        rejected = []
        for r in requests:
            try:
                self.scheduler.add_request(r)
            except RequestRejected as e:
                rejected.append((r, e))
        return rejected

    def abort(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Abort requests; unknown or already finished ids are ignored.

        Blocks are freed at once even when a step of the request is in
        flight: any later step that reuses them runs after that one, and the
        in-flight step's output for it is dropped.
        """
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        """True while a step would do anything (including reporting finishes or draining a step in flight)."""
        return self.scheduler.has_requests() or bool(self._in_flight)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    @property
    def num_in_flight(self) -> int:
        """Steps scheduled whose output is not applied yet (0 in sync mode)."""
        return len(self._in_flight)

    def step(self, throttle_prefills: bool = False) -> EngineStep | None:
        """Run one cycle; sync: schedule, execute, update. Async: see the class docstring.

        ``throttle_prefills`` is passed to ``Scheduler.schedule`` (the
        data-parallel prefill cadence).
        """
        if self.async_scheduling:
            return self._step_async(throttle_prefills)
        return self._update(self._schedule(throttle_prefills, submit=False))

    def _step_async(self, throttle_prefills: bool) -> EngineStep | None:
        sched = self.scheduler
        queue = self._in_flight
        self.last_scheduled = None
        if sched.has_requests():
            item = self._schedule(throttle_prefills, submit=True)
            queue.append(item)
            if len(queue) < BATCH_QUEUE_SIZE and (item.so.total_num_scheduled_tokens or sched.has_requests()):
                # Keep this step in flight; its output is applied next call,
                # after the following step is scheduled.
                return None
        if queue:
            return self._update(queue.popleft())
        return None

    def _schedule(self, throttle_prefills: bool, submit: bool) -> _InFlight:
        sched = self.scheduler
        now = time.monotonic()
        t0 = time.perf_counter_ns()
        so = self.last_scheduled = sched.schedule(throttle_prefills)
        t1 = time.perf_counter_ns()
        # An empty batch still goes to the executor when it must drop state.
        result: ModelRunnerOutput | Future[ModelRunnerOutput] | None = None
        if self._skip_empty_steps and not (so.scheduled or so.finished_req_ids or so.preempted):
            result = _EMPTY_RESULT
        elif submit:
            result = submit_step(self.executor, so)
        return _InFlight(so, result, len(sched.running), sched.num_waiting, sched.kv.usage, t1 - t0, now)

    def _update(self, item: _InFlight) -> EngineStep:
        t2 = time.perf_counter_ns()
        result = item.result
        if result is None:
            result = self.executor.execute(item.so)
        elif not isinstance(result, ModelRunnerOutput):
            result = result.result()
        t3 = time.perf_counter_ns()
        outputs = self.scheduler.update_from_output(item.so, result)
        t4 = time.perf_counter_ns()
        return EngineStep(
            item.so,
            result,
            outputs,
            item.num_running,
            item.num_waiting,
            item.kv_usage,
            item.schedule_ns,
            t3 - t2,
            t4 - t3,
            item.schedule_time,
        )

    def sole_in_flight(self) -> SchedulerOutput | None:
        """The step in flight when exactly one is (async mode), already handed to the executor."""
        queue = self._in_flight
        if len(queue) != 1 or queue[0].result is None:
            return None
        return queue[0].so

    def replace_in_flight(self, so: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Put ``so`` (executed: ``result``) in flight instead of the sole step there.

        For a simulator that applied the calls between them itself (see
        ``PlainDecodes.advance_async_decode_steps``); ``so`` is the last step those
        calls scheduled.
        """
        if self.sole_in_flight() is None:
            raise RuntimeError("replace_in_flight() needs exactly one step in flight")
        sched = self.scheduler
        self.last_scheduled = so
        self._in_flight[0] = _InFlight(
            so, result, len(sched.running), sched.num_waiting, sched.kv.usage, 0, time.monotonic()
        )

    def swap_in_flight(
        self,
        so: SchedulerOutput,
        result: ModelRunnerOutput,
        num_running: int,
        num_waiting: int,
        kv_usage: float,
    ) -> tuple[SchedulerOutput, ModelRunnerOutput, int]:
        """Put ``so`` (executed: ``result``; the queue sizes and KV usage after its schedule) in flight.

        For a simulator that ran an engine call's schedule() and update itself:
        returns the sole step that was in flight, its output and its running
        count, for the caller to apply.
        """
        if self.sole_in_flight() is None:
            raise RuntimeError("swap_in_flight() needs exactly one step in flight")
        old = self._in_flight[0]
        self.last_scheduled = so
        self._in_flight[0] = _InFlight(so, result, num_running, num_waiting, kv_usage, 0, time.monotonic())
        return old.so, old.result, old.num_running  # type: ignore[return-value]

    def drain(self) -> list[EngineStep]:
        """Apply every step still in flight (async mode), scheduling nothing new."""
        steps = []
        while self._in_flight:
            steps.append(self._update(self._in_flight.popleft()))
        return steps

    def close(self) -> None:
        """Wait for any step in flight, then shut the executor down."""
        for item in self._in_flight:
            if isinstance(item.result, Future):
                item.result.exception()
        self._in_flight.clear()
        self.executor.close()
