"""Building requests and stepping a bare Scheduler, for the scheduler's unit tests."""

from __future__ import annotations

import zlib

from llmsched.core import (
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepOutputs,
)


def make_sched(**overrides: object) -> Scheduler:
    """A scheduler over 4-token blocks with invariants checked after every step."""
    settings: dict[str, object] = {
        "num_gpu_blocks": 257,
        "max_model_len": 256,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        "block_size": 4,
        "debug": True,
    }
    settings.update(overrides)
    return Scheduler(SchedulerConfig(**settings))


def make_req(
    rid: str,
    prompt_len: int,
    max_tokens: int = 16,
    params: SamplingParams | None = None,
    **kwargs: object,
) -> Request:
    """A request with a prompt unique to its id (no prefix hits); EOS ignored unless ``params`` say so."""
    base = (zlib.crc32(rid.encode()) % 100_000) * 1_000
    if params is None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [base + j for j in range(prompt_len)], params, **kwargs)


def run_step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, StepOutputs]:
    """schedule(), then one token for each request that finished its known tokens."""
    out = sched.schedule()
    sampled = [[token] if r.num_computed_tokens >= r.num_tokens else [] for r in out.scheduled]
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled))


def ran(out: SchedulerOutput) -> dict[str, int]:
    """Scheduled tokens by request id, in schedule order."""
    return out.num_scheduled_tokens_by_id()


def waiting_ids(sched: Scheduler) -> list[str]:
    """Waiting request ids in admission order."""
    return [r.request_id for r in sched.waiting]


def running_ids(sched: Scheduler) -> list[str]:
    """Running request ids in running order."""
    return [r.request_id for r in sched.running]


def fabricate(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """One token for each scheduled request that is not a partial prefill chunk, decided at schedule time."""
    return ModelRunnerOutput([[] if r.is_prefill_chunk else [token] for r in out.scheduled])


class Pipeline:
    """Drives an async-mode scheduler as the engine's batch queue does.

    ``schedule()`` plans a step and fabricates its output at once (as a
    model would sample it, though the scheduler only learns it later);
    ``update()`` applies the oldest step still in flight.
    """

    def __init__(self, sched: Scheduler, token: int = 7) -> None:
        self.sched = sched
        self.token = token
        self.in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []

    def schedule(self) -> SchedulerOutput:
        """Plan a step; it stays in flight until ``update``."""
        out = self.sched.schedule()
        self.in_flight.append((out, fabricate(out, self.token)))
        return out

    def update(self, result: ModelRunnerOutput | None = None) -> StepOutputs:
        """Apply the oldest step in flight (its fabricated output, or ``result``)."""
        out, made = self.in_flight.pop(0)
        return self.sched.update_from_output(out, made if result is None else result)

    def step(self) -> tuple[SchedulerOutput, StepOutputs | None]:
        """One engine turn: schedule, then apply the older step if two are in flight."""
        out = self.schedule()
        return out, self.update() if len(self.in_flight) == 2 else None
