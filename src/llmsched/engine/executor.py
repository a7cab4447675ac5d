"""The Executor protocol: how the engine hands a batch to a model (or a stand-in)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from llmsched.core.output import ModelRunnerOutput, SchedulerOutput


@runtime_checkable
class Executor(Protocol):
    """Runs one scheduled batch and reports the sampled tokens.

    ``execute`` must return one entry per ``scheduler_output.scheduled``
    request, in that order. It must treat the Request objects as read-only,
    and should drop any per-request state for ``finished_req_ids`` and
    ``preempted`` (a preempted request comes back later as an admission).
    """

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the batch."""
        ...

    def close(self) -> None:
        """Release resources; the executor is not used afterwards."""
        ...
