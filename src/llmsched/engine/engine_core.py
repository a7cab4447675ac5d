"""The engine loop: schedule, execute, update, one step at a time."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import RequestRejected
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput, StepOutputs
from llmsched.core.policy import Policy
from llmsched.core.request import Request, RequestStatus
from llmsched.core.scheduler import Scheduler
from llmsched.engine.executor import Executor

_EMPTY_RESULT = ModelRunnerOutput(sampled_token_ids=())


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
    execute_ns: int
    update_ns: int


class EngineCore:
    """Couples a Scheduler to an Executor; contains no scheduling logic itself."""

    def __init__(self, config: SchedulerConfig, executor: Executor, policy: Policy | None = None) -> None:
        self.config = config
        self.scheduler = Scheduler(config, policy)
        self.executor = executor

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
        """Abort requests; unknown or already finished ids are ignored."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        """True while a step would do anything (including reporting finishes)."""
        return self.scheduler.has_requests()

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineStep:
        """Run one schedule / execute / update cycle."""
        sched = self.scheduler
        t0 = time.perf_counter_ns()
        so = sched.schedule()
        t1 = time.perf_counter_ns()
        num_running, num_waiting = len(sched.running), len(sched.waiting)
        kv_usage = sched.kv.usage
        t2 = time.perf_counter_ns()
        # An empty batch still goes to the executor when it must drop state.
        if so.scheduled or so.finished_req_ids or so.preempted:
            result = self.executor.execute(so)
        else:
            result = _EMPTY_RESULT
        t3 = time.perf_counter_ns()
        outputs = sched.update_from_output(so, result)
        t4 = time.perf_counter_ns()
        return EngineStep(so, result, outputs, num_running, num_waiting, kv_usage, t1 - t0, t3 - t2, t4 - t3)

    def close(self) -> None:
        """Shut the executor down."""
        self.executor.close()
