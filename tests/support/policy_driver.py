"""A small step loop that drives a Scheduler under any policy with fabricated tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmsched.core import (
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

STEP_S = 0.01  # virtual seconds per step


@dataclass(frozen=True)
class Spec:
    """One request: when it arrives (step), its lengths, priority and tenant."""

    rid: str
    arrival_step: int
    prompt_len: int
    max_tokens: int
    priority: int = 0
    tenant: str | None = None

    def make(self) -> Request:
        """A fresh request; arrival time on the virtual clock."""
        prompt = [1000 + int(self.rid.strip("r") or 0)] + [5] * (self.prompt_len - 1)
        return Request(
            self.rid,
            prompt,
            SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
            priority=self.priority,
            arrival_time=self.arrival_step * STEP_S,
            tenant=self.tenant,
        )


@dataclass
class Run:
    """What happened: per request the first step it ran, the step it ended, its status."""

    first_scheduled: dict[str, int] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=dict)
    declined: set[str] = field(default_factory=set)
    # Requests that sampled at least one token.
    sampled: set[str] = field(default_factory=set)
    admitted_order: list[str] = field(default_factory=list)
    steps: int = 0
    traces: list = field(default_factory=list)
    # Tokens scheduled per tenant, per step.
    service: list[dict[str | None, int]] = field(default_factory=list)


def config(**kw: object) -> SchedulerConfig:
    """A small scheduler config with invariant checks after every step."""
    base: dict = {
        "num_gpu_blocks": 64,
        "max_model_len": 512,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "block_size": 16,
        "debug": True,
    }
    base.update(kw)
    return SchedulerConfig(**base)


def drive(
    cfg: SchedulerConfig,
    specs: list[Spec],
    max_steps: int = 20000,
    trace: bool = False,
    on_step: Callable[[Scheduler, SchedulerOutput], None] | None = None,
) -> Run:
    """Run every request to its end; the scheduler checks its invariants after each step (debug).

    ``on_step`` sees the scheduler right after each schedule() call.
    """
    s = Scheduler(cfg)
    run = Run()
    now = [0.0]
    s.clock = lambda: now[0]
    if trace:
        s.enable_trace()
    pending = sorted(specs, key=lambda x: x.arrival_step)
    tenant_of = {sp.rid: sp.tenant for sp in specs}
    k = 0
    step = 0
    while k < len(pending) or s.has_requests():
        now[0] = step * STEP_S
        while k < len(pending) and pending[k].arrival_step <= step:
            s.add_request(pending[k].make())
            k += 1
        out = s.schedule()
        if trace:
            run.traces.append(out.trace)
        if on_step is not None:
            on_step(s, out)
        served: dict[str | None, int] = {}
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            run.first_scheduled.setdefault(req.request_id, step)
            served[tenant_of[req.request_id]] = served.get(tenant_of[req.request_id], 0) + n
        run.service.append(served)
        run.admitted_order.extend(r.request_id for r in out.admitted if r.num_preemptions == 0)
        sampled = [[] if r.is_prefill_chunk else [7] for r in out.scheduled]
        run.sampled.update(r.request_id for r, t in zip(out.scheduled, sampled) if t)
        res = s.update_from_output(out, ModelRunnerOutput(sampled))
        for r in res.finished:
            run.finished[r.request_id] = step
            if r.stop_reason == "declined":
                run.declined.add(r.request_id)
        step += 1
        assert step < max_steps, "the workload did not finish: something starves"
    run.steps = step
    assert s.kv.num_free_blocks == cfg.num_gpu_blocks - 1, "KV blocks leaked"
    return run
