"""The Executor protocol: how the engine hands a batch to a model (or a stand-in)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from llmsched.core.output import ModelRunnerOutput, SchedulerOutput


@runtime_checkable
class Executor(Protocol):
    """Runs one scheduled batch and reports the sampled tokens.

    ``execute`` must return one entry per ``scheduler_output.scheduled``
    request, in that order. It must treat the Request objects as read-only,
    and should drop any per-request state for ``finished_req_ids`` and
    ``preempted`` (a preempted request comes back later as an admission).

    With async scheduling the engine hands over step N+1 before step N's
    output is applied to the requests: a decode's input token may then be
    one the executor sampled itself and the Request does not hold yet. An
    executor that runs steps in the background offers ``submit(so)``,
    returning a Future, and reads every Request field it needs during the
    call (the engine changes them right after). One without ``submit`` is
    simply run at once (``execute``), which is right for executors that
    fabricate their output from the schedule, as the replay and simulator
    executors do.

    With speculative decoding, an admission with one token left may be
    scheduled as a full draft step (1 + K tokens, as vLLM pads it): its K
    draft slots are placeholders (-1 in ``spec_decode_tokens``) that no
    proposer made. An executor must accept such a step and reject every
    placeholder: it returns the one sampled token (the scheduler takes the
    placeholder slots back) and counts none in ``num_drafts_verified``.
    """

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the batch."""
        ...

    def close(self) -> None:
        """Release resources; the executor is not used afterwards."""
        ...


def submit_step(
    executor: Executor, scheduler_output: SchedulerOutput
) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
    """Hand a step over without waiting when the executor can run it in the background."""
    submit = getattr(executor, "submit", None)
    if submit is not None:
        return submit(scheduler_output)
    return executor.execute(scheduler_output)
