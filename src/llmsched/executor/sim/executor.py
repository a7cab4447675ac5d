"""SimExecutor: runs a scheduled batch on a cost model and a virtual clock.

Like the replay executor it fabricates one token for every request whose
computed count reaches its token count (a partial prefill chunk samples
nothing). Instead of running a model it prices the batch with a cost model
and advances ``now`` by that many simulated seconds.

The clock, sync scheduling: a step is its host path, then its model time,
then the next step (``now += step_time``, exactly as the cost model prices
it). Async scheduling (vLLM's batch queue of two): the engine schedules
step N+1 and issues its work while step N runs on the device, then waits
for step N's output. The executor models that as two resources in a
pipeline:

- the host starts step N's host path when it schedules it (``now``, which
  the runner also moves forward to step N-2's model end when it applies
  that step's output, as the engine waits for it);
- the device starts step N's forward when both its host path is done and
  step N-1's forward has ended, and runs it for the model time.

In steady state a step then costs max(host, model) on the clock: a
host-bound engine leaves the device idle for host - model between forwards,
a model-bound one hides its host path entirely. The first step of a busy
period (after the engine was idle) overlaps nothing and costs host + model,
as in sync mode; an idle engine's clock jumps to the next arrival. Each
executed batch's timing (``StepTiming``) says when its tokens exist (its
forward's end), which the runner uses when the engine applies that step,
one call later.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any, Protocol

from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.core.request import Request
from llmsched.executor.sim.cost_model import (
    AsyncDecodeRunFn,
    BatchShape,
    DecodeRunFn,
    StepCostModel,
    StepParts,
    async_decode_run_of,
    decode_run_of,
    decode_step_parts_of,
    step_parts_of,
)

_NONE: tuple[int, ...] = ()
# An empty array of doubles; a partial builds it without a Python frame (four per decode run).
_doubles = partial(array, "d")


@dataclass(slots=True)
class StepTiming:
    """One executed batch on the virtual clock: its parts and when it ran."""

    # SchedulerOutput.step of the batch (-1: this record holds none yet).
    step: int = -1
    # When its host path began (the schedule() call).
    start: float = 0.0
    # When its forward ended: its sampled tokens exist from here.
    end: float = 0.0
    host: float = 0.0
    model: float = 0.0
    # Device time spent waiting for this step's host path (sync: all of it;
    # async: what the previous forward did not hide).
    host_gap: float = 0.0
    # The clock time the step accounts for: sync, its price (host + model);
    # async, from the previous forward's end (or its own start, after idle)
    # to its own forward's end: max(host, model) in steady state.
    duration: float = 0.0
    batch: BatchShape = field(default_factory=BatchShape)


class PipelinedCosts(Protocol):
    """Running totals of executed async steps (the simulator's StepCosts)."""

    num_steps: int
    host_s: float
    model_s: float
    host_gap_s: float
    host_gaps: array


@dataclass(slots=True)
class DecodeRun:
    """Steps clocked by ``SimExecutor.run_decodes``: each one's end and parts (sync: host gap = host)."""

    ends: array = field(default_factory=_doubles)
    totals: array = field(default_factory=_doubles)
    hosts: array = field(default_factory=_doubles)
    models: array = field(default_factory=_doubles)

    def __len__(self) -> int:
        return len(self.ends)


class SimExecutor:
    """Implements the Executor protocol with simulated time instead of a model."""

    def __init__(
        self,
        cost_model: StepCostModel,
        sample_token_id: int = 7,
        start_time: float = 0.0,
        async_scheduling: bool = False,
    ) -> None:
        self.cost_model = cost_model
        self._parts = step_parts_of(cost_model)
        self._decode_runs: dict[int, DecodeRunFn] = {}
        self._async_runs: dict[int, AsyncDecodeRunFn] = {}
        self._decode_parts: dict[int, Callable[[int], StepParts]] = {}
        # Only a cost model with a LoRA rank prices adapter tokens (a second pass over the batch).
        self.prices_lora = bool(getattr(cost_model, "lora_rank", 0))
        self.now = start_time
        self.async_scheduling = async_scheduling
        # False: async scheduling overlaps nothing (see HardwareProfile.host_overlaps_model).
        self.host_overlaps_model = getattr(cost_model, "host_overlaps_model", True)
        self.sample_token_id = sample_token_id
        self._token = (sample_token_id,)
        # When the device finishes the last forward issued (async pipeline).
        self.device_free_at = start_time
        # What the last execute() did, for the runner's bookkeeping.
        self.last_duration = 0.0
        self.last_batch = BatchShape()
        self.last_sampled: list[Request] = []
        # The timings of the last two executed batches, reused in turn: at
        # most two steps are ever scheduled and not yet applied.
        self._last = StepTiming()
        self._prev = StepTiming()
        # Prices the images a step encodes (a vision_cost.VisionCost), when
        # the workload has any; their time adds to the step's model time.
        self.vision: Any = None
        self.vision_seconds = 0.0
        # Speculative decoding (a spec_decode.SimSpecDecode), when configured:
        # decodes verify drafts and every sampling request proposes K more.
        self.spec: Any = None

    def advance_to(self, t: float) -> None:
        """Move the clock forward to ``t`` (an idle engine waiting for arrivals, or for a step's output)."""
        if t > self.now:
            self.now = t

    def timing(self, step: int) -> StepTiming | None:
        """The timing of executed batch ``step`` (None: never executed); valid for two more executions."""
        t = self._last
        if t.step == step:
            return t
        t = self._prev
        return t if t.step == step else None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Price the batch, advance the clock, sample one token per completed request."""
        if self.spec is not None:
            return execute_speculative(self, scheduler_output)
        batch, sampled, samplers = self._shape(scheduler_output)
        self._price(scheduler_output, batch)
        self.last_sampled = samplers
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def execute_with_decodes(
        self, scheduler_output: SchedulerOutput, num_decodes: int, decode_context: int
    ) -> StepTiming:
        """Clock the batch plus ``num_decodes`` one-token decodes it does not list; its timing.

        Sync scheduling only, without speculative decoding. For steps whose
        decodes the caller does not build (the simulator's cohort steps):
        ``decode_context`` is their summed computed counts after scheduling,
        as ``execute()`` sums them; each samples a token, as do the listed
        requests that complete. ``last_sampled`` is left empty.
        """
        if self.async_scheduling or self.spec is not None or self.prices_lora:
            raise ValueError("execute_with_decodes() clocks sync steps without drafts or LoRA pricing only")
        batch = self._shape(scheduler_output)[0]
        batch.num_tokens += num_decodes
        batch.num_sampled += num_decodes
        batch.num_decodes += num_decodes
        batch.decode_context += decode_context
        self.last_sampled = []
        return self._price(scheduler_output, batch)

    def execute_after_decodes(
        self, scheduler_output: SchedulerOutput, num_decodes: int, decode_context: int
    ) -> ModelRunnerOutput:
        """``execute()`` of a batch whose first ``num_decodes`` requests are one-token decodes not read.

        Async scheduling, without speculative decoding or LoRA pricing. For
        the simulator's cohort calls: ``decode_context`` is those decodes'
        summed computed counts after scheduling, as ``execute()`` sums them;
        each samples a token. ``last_sampled`` is left empty.
        """
        if not self.async_scheduling or self.spec is not None or self.prices_lora:
            raise ValueError("execute_after_decodes() clocks async steps without drafts or LoRA pricing only")
        batch, sampled, _ = self._shape(scheduler_output, num_decodes)
        batch.num_tokens += num_decodes
        batch.num_sampled += num_decodes
        batch.num_decodes += num_decodes
        batch.decode_context += decode_context
        self.last_sampled = []
        self._price(scheduler_output, batch)
        return ModelRunnerOutput(sampled_token_ids=[self._token] * num_decodes + sampled)

    def _shape(
        self, so: SchedulerOutput, skip: int = 0
    ) -> tuple[BatchShape, list[tuple[int, ...]], list[Request]]:
        """The batch's shape, each listed request's sampled tokens, and the requests that sample.

        ``skip``: leave out the first so many listed requests.
        """
        token = self._token
        sampled: list[tuple[int, ...]] = []
        samplers: list[Request] = []
        num_tokens = prefill_tokens = prefill_pairs = prefill_context = 0
        num_decodes = decode_context = num_prefills = prefill_causal = 0
        # recompute_from is not charged: the cost model prices the step vLLM
        # would run, and vLLM never recomputes a withdrawn chunk's blocks (it
        # reads them as cached). The extra tokens are this project's torch
        # executor's repair, and rare.
        listed = zip(so.scheduled, so.num_scheduled_tokens)
        if skip:
            listed = islice(listed, skip, None)
        for req, n in listed:
            end = req.num_computed_tokens
            num_tokens += n
            if n == 1:
                num_decodes += 1
                decode_context += end
            else:
                start = end - n
                num_prefills += 1
                prefill_tokens += n
                causal = n * (n + 1) >> 1
                prefill_causal += causal
                prefill_pairs += n * start + causal
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
            prefill_causal=prefill_causal,
        )
        if self.prices_lora:
            _count_lora(batch, so)
        return batch, sampled, samplers

    def _price(self, so: SchedulerOutput, batch: BatchShape) -> StepTiming:
        """Clock ``so``'s step as ``batch``, its images encoded on the device first."""
        extra = 0.0
        enc = so.encoder_inputs
        if enc and self.vision is not None:
            extra = self.vision.seconds(sum(len(v) for v in enc.values()))
            self.vision_seconds += extra
        d = batch.num_decodes
        if d and d == batch.num_tokens == batch.num_sampled and not batch.lora_tokens and not extra:
            # One-token decodes only: the per-size price of their context
            # (decode_step_parts: step_parts' figures bit for bit, a fraction of the work).
            total, host, model = self._decode_parts_of(d)(batch.decode_context)
            return self._clock(so.step, batch, total, host, model)
        return self._run(so.step, batch, extra)

    def _decode_parts_of(self, d: int) -> Callable[[int], StepParts]:
        """``decode_step_parts`` of ``d`` one-token decodes (step_parts' figures exactly), kept per size."""
        parts = self._decode_parts.get(d)
        if parts is None:
            parts = self._decode_parts[d] = decode_step_parts_of(self.cost_model, d)
        return parts

    def run_decodes(
        self, first_step: int, num_decodes: int, decode_context: int, num_steps: int, until: float
    ) -> DecodeRun:
        """Clock up to ``num_steps`` steps of the same one-token decodes, each starting before ``until``.

        Sync scheduling only. Each step is priced and clocked as ``execute()``
        would its batch (``decode_context``: the requests' summed computed
        counts before the first step; each step adds one per request), and
        the last one's timing is kept for ``timing()``. For steps whose
        requests the caller does not build (the simulator's plain decode
        steps); ``last_sampled`` is left empty.
        """
        if self.async_scheduling:
            raise ValueError("run_decodes() clocks sync steps only")
        d = num_decodes
        clock = self._decode_runs.get(d)
        if clock is None:
            # Kept per batch size: a simulation runs thousands of short runs of few sizes.
            clock = self._decode_runs[d] = decode_run_of(self.cost_model, d)
        run = DecodeRun()
        # _serial's arithmetic per step: a step ends its price after it starts.
        n, start, _end, ctx = clock(
            decode_context, self.now, until, num_steps, run.ends, run.totals, run.hosts, run.models
        )
        if n:
            # The last step's timing kept as _run keeps execute()'s (its price
            # is step_parts' bit for bit: decode_step_parts is tested to be).
            self.now = start
            self._clock(
                first_step + n - 1,
                BatchShape(d, d, 0, 0, 0, d, ctx, 0),
                run.totals[-1],
                run.hosts[-1],
                run.models[-1],
            )
            self.last_sampled = []
        return run

    def run_async_decodes(
        self,
        first_step: int,
        num_decodes: int,
        decode_context: int,
        num_steps: int,
        until: float,
        last_shape: tuple[int, int] | None,
        costs: PipelinedCosts,
        itl: dict[float, int],
        sampled_at: float,
    ) -> array:
        """Clock up to ``num_steps`` async calls of the same one-token decodes, each begun before ``until``.

        Async scheduling only. Call j schedules step ``first_step + j``
        (priced and pipelined as ``execute()`` would its batch;
        ``decode_context``: the summed computed counts before the first) and
        then applies the step before it, whose forward end the clock waits
        for, as the simulator's engine loop does. Step ``first_step - 1``
        must be the last one executed. ``last_shape``: the last call's
        (decodes, summed context) when it schedules fewer (some finish).
        The applied steps are counted into ``costs`` as its ``add``
        counts an executed step, one by one, and each one's gap from the one
        before (``sampled_at``: the end of the step before the first) into
        the inter-token histogram ``itl``, ``num_decodes`` times each;
        returns their forward ends. The last two steps scheduled are kept
        for ``timing()``.
        """
        if not self.async_scheduling:
            raise ValueError("run_async_decodes() clocks async steps only")
        d = num_decodes
        clock = self._async_runs.get(d)
        if clock is None:
            clock = self._async_runs[d] = async_decode_run_of(self.cost_model, d, self.host_overlaps_model)
        prev = self._last
        if prev.step != first_step - 1:
            raise ValueError(f"run_async_decodes() follows step {prev.step}, not {first_step - 1}")
        same = num_steps
        last_host = last_model = 0.0
        if last_shape is not None:
            same -= 1
            dl, cl = last_shape
            _, last_host, last_model = self._decode_parts_of(dl)(cl)
        ends = _doubles()
        pending = (prev.start, 0.0, prev.end, prev.host, prev.model, prev.host_gap)
        n, now, _, host_s, model_s, gap_s, last, before = clock(
            decode_context, self.now, self.device_free_at, until, num_steps, same, last_host, last_model,
            pending, ends, costs.host_gaps, costs.host_s, costs.model_s, costs.host_gap_s, itl, d, sampled_at,
        )  # fmt: skip
        if n:
            costs.num_steps += n
            costs.host_s, costs.model_s, costs.host_gap_s = host_s, model_s, gap_s
            self.now = now
            if n > 1:
                # The last step applied is the one before the last scheduled.
                self._keep_decodes(first_step, n - 2, before, d, decode_context, same, last_shape)
            self._keep_decodes(first_step, n - 1, last, d, decode_context, same, last_shape)
            self.last_sampled = []
        return ends

    def _keep_decodes(
        self,
        first_step: int,
        j: int,
        parts: tuple[float, float, float, float, float, float],
        d: int,
        decode_context: int,
        same: int,
        last_shape: tuple[int, int] | None,
    ) -> None:
        """Keep step ``j`` of a run of async decode calls for ``timing()``, as ``_clock`` keeps one."""
        t = self._prev
        self._prev = self._last
        self._last = t
        t.step = first_step + j
        if j == same:
            dl, cl = last_shape  # type: ignore[misc]
            t.batch = BatchShape(dl, dl, 0, 0, 0, dl, cl, 0)
        else:
            t.batch = BatchShape(d, d, 0, 0, 0, d, decode_context + d * (j + 1), 0)
        start, idle_from, end, host, model, gap = parts
        t.start, t.end, t.host, t.model, t.host_gap = start, end, host, model, gap
        t.duration = end - idle_from
        self.device_free_at = end
        self.last_duration = t.duration
        self.last_batch = t.batch

    def _run(self, step: int, batch: BatchShape, encoder_s: float = 0.0, host_s: float = 0.0) -> StepTiming:
        """Clock one executed batch (plus ``encoder_s`` on the device, ``host_s`` on the host); its timing."""
        if batch.num_tokens:
            total, host, model = self._parts(batch)
            total += encoder_s + host_s
            model += encoder_s
            host += host_s
        else:
            total = host = model = 0.0
        return self._clock(step, batch, total, host, model)

    def _clock(self, step: int, batch: BatchShape, total: float, host: float, model: float) -> StepTiming:
        """Clock batch ``step`` priced (``total``, ``host``, ``model``); its timing, kept for ``timing()``."""
        t = self._prev
        self._prev = self._last
        self._last = t
        t.step = step
        t.batch = batch
        if self.async_scheduling and batch.num_tokens:
            self._pipeline(t, host, model)
        else:
            self._serial(t, total, host, model)
        self.last_duration = t.duration
        self.last_batch = batch
        return t

    def _serial(self, t: StepTiming, total: float, host: float, model: float) -> None:
        """Sync (or a batch with no tokens): host path then model, the clock moved by the step's price."""
        start = self.now
        end = start + total
        t.start = start
        t.end = self.now = end
        t.host = host
        t.model = model
        t.host_gap = host
        t.duration = total
        if end > self.device_free_at:
            self.device_free_at = end

    def _pipeline(self, t: StepTiming, host: float, model: float) -> None:
        """Async: this host path runs now; the forward follows it and the previous forward."""
        start = self.now
        prev_end = self.device_free_at
        if prev_end > start and not self.host_overlaps_model:
            # No core is free for the host path while the forward runs.
            start = prev_end
        host_end = start + host
        # The device is idle from the later of the previous forward's end and
        # this step's start until the host path is done.
        idle_from = prev_end if prev_end > start else start
        begin = host_end if host_end > prev_end else prev_end
        end = begin + model
        t.start = start
        t.end = end
        t.host = host
        t.model = model
        t.host_gap = host_end - idle_from if host_end > idle_from else 0.0
        t.duration = end - idle_from
        self.device_free_at = end
        # The host is free for the next schedule() once this host path is
        # done; the engine's wait for the previous step's output is the
        # runner's advance_to() when it applies that step.
        self.now = host_end

    def close(self) -> None:
        """Nothing to release."""


def execute_speculative(ex: SimExecutor, so: SchedulerOutput) -> ModelRunnerOutput:
    """``execute()`` under speculative decoding: verify the scheduled drafts, propose K more.

    As the torch executor reports them: each sampling request gets 1 +
    accepted tokens (accepted drawn from the acceptance model), drafts to
    verify next step (sync mode; async mode uses the scheduler's
    placeholders) and its verified draft count. A verifying request's 1 + K
    tokens are priced as a chunk at its context (its attention pairs) that
    a CUDA graph still covers (``spec_tokens``), every verified position
    runs the LM head, and the drafting costs what ``SimSpecDecode`` says.
    """
    spec = ex.spec
    token = ex.sample_token_id
    drafts_of = so.spec_decode_tokens
    n_sched = len(so.scheduled)
    sampled: list[tuple[int, ...]] = [_NONE] * n_sched
    draft_ids: list[list[int]] = [[] for _ in range(n_sched)]
    verified = [0] * n_sched
    samplers: list[Request] = []
    proposal = [token] * spec.k
    b = BatchShape()
    proposing_context = 0
    for i, (req, n) in enumerate(zip(so.scheduled, so.num_scheduled_tokens)):
        end = req.num_computed_tokens
        b.num_tokens += n
        drafts = drafts_of.get(req.request_id) if drafts_of else None
        if n == 1:
            b.num_decodes += 1
            b.decode_context += end
        else:
            start = end - n
            b.num_prefills += 1
            b.prefill_tokens += n
            causal = n * (n + 1) >> 1
            b.prefill_causal += causal
            b.prefill_pairs += n * start + causal
            b.prefill_context += start
            if drafts:
                b.spec_tokens += n
        if end < req.num_tokens:
            continue
        v = len(drafts) if drafts else 0
        verified[i] = v
        sampled[i] = (token,) * (1 + spec.accepted(v)) if v else (token,)
        b.num_sampled += 1 + v
        samplers.append(req)
        draft_ids[i] = proposal
        proposing_context += end
    if ex.prices_lora:
        _count_lora(b, so)
    host_s, device_s = spec.drafting_seconds(len(samplers), proposing_context)
    enc = so.encoder_inputs
    if enc and ex.vision is not None:
        images = ex.vision.seconds(sum(len(v) for v in enc.values()))
        ex.vision_seconds += images
        device_s += images
    ex._run(so.step, b, device_s, host_s)
    ex.last_sampled = samplers
    return ModelRunnerOutput(
        sampled_token_ids=sampled, draft_token_ids=draft_ids, num_drafts_verified=verified
    )


def _count_lora(batch: BatchShape, so: SchedulerOutput) -> None:
    """Fill the batch's adapter-token and distinct-adapter counts."""
    ids = set()
    tokens = 0
    for req, n in zip(so.scheduled, so.num_scheduled_tokens):
        if req.lora_id:
            tokens += n
            ids.add(req.lora_id)
    batch.lora_tokens = tokens
    batch.num_loras = len(ids)
