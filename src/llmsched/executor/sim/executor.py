"""SimExecutor: runs a scheduled batch on a cost model and a virtual clock.

Like the replay executor it fabricates one token for every request whose
computed count reaches its token count (a partial prefill chunk samples
nothing). Instead of running a model it prices the batch with a cost model
and advances ``now`` by that many simulated seconds.
"""

from __future__ import annotations

from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.core.request import Request
from llmsched.executor.sim.cost_model import BatchShape, StepCostModel

_NONE: tuple[int, ...] = ()


class SimExecutor:
    """Implements the Executor protocol with simulated time instead of a model."""

    def __init__(self, cost_model: StepCostModel, sample_token_id: int = 7, start_time: float = 0.0) -> None:
        self.cost_model = cost_model
        self.now = start_time
        self._token = (sample_token_id,)
        # What the last execute() did, for the runner's bookkeeping.
        self.last_duration = 0.0
        self.last_batch = BatchShape()
        self.last_sampled: list[Request] = []

    def advance_to(self, t: float) -> None:
        """Move the clock forward to ``t`` (an idle engine waiting for arrivals)."""
        if t > self.now:
            self.now = t

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Price the batch, advance the clock, sample one token per completed request."""
        token = self._token
        sampled: list[tuple[int, ...]] = []
        samplers: list[Request] = []
        num_tokens = prefill_tokens = prefill_pairs = prefill_context = 0
        num_decodes = decode_context = num_prefills = 0
        # recompute_from is not charged: the cost model prices the step vLLM
        # would run, and vLLM never recomputes a withdrawn chunk's blocks (it
        # reads them as cached). The extra tokens are this project's torch
        # executor's repair, and rare.
        for req, n in zip(scheduler_output.scheduled, scheduler_output.num_scheduled_tokens):
            end = req.num_computed_tokens
            num_tokens += n
            if n == 1:
                num_decodes += 1
                decode_context += end
            else:
                start = end - n
                num_prefills += 1
                prefill_tokens += n
                prefill_pairs += n * start + (n * (n + 1) >> 1)
                prefill_context += start
            if end >= req.num_tokens:
                sampled.append(token)
                samplers.append(req)
            else:
                sampled.append(_NONE)
        batch = BatchShape(
            num_tokens,
            len(samplers),
            prefill_tokens,
            prefill_pairs,
            prefill_context,
            num_decodes,
            decode_context,
            num_prefills,
        )
        duration = self.cost_model.step_time(batch) if num_tokens else 0.0
        self.now += duration
        self.last_duration = duration
        self.last_batch = batch
        self.last_sampled = samplers
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def close(self) -> None:
        """Nothing to release."""
