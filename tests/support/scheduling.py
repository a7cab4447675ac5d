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
