"""One engine in the simulation loop: an EngineCore on a SimExecutor's clock, sync or async.

With async scheduling (``SchedulerConfig.async_scheduling``) a call
schedules one step and applies the one before it. The executor keeps each
executed batch's timing (``StepTiming``): a step's tokens, finishes and
trace line are timed by that step's own forward end, when the engine
applies it, and the clock moves to that end then (the engine waits for the
step's output). Trace lines carry the loop turn at which the step was
scheduled and the requests added before it, as ``llmsched replay`` writes
them for an async workload.

Sync steps in which every running request decodes one token and nothing
else can happen are applied without building their batches (see
``PlainDecodes.plain_decode_steps``): the same steps, trace and figures.
Without a trace or series, plainly decoding requests are moreover kept as
a ``DecodeCohort`` across steps that admit others, so such steps cost
their admissions and block events, not a pass over the batch.

With async scheduling, and without a trace or series, engine calls that
schedule one token for every running request and apply the plain decode
step in flight before them are run together likewise (see
``PlainDecodes.async_plain_decode_steps`` and ``SimExecutor.run_async_decodes``):
the same calls, clock and figures, the last step they schedule left in flight.
Plainly decoding requests are moreover kept as an ``AsyncDecodeCohort``
across the calls that admit others (and the cohort runs its own plain
calls), so such a call costs its admissions, the first decodes of the
requests admitted the call before, and block events, not a pass over the
batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import IO

from llmsched.bench.replay import step_record
from llmsched.core.config import SchedulerConfig
from llmsched.core.decode_cohort import AsyncDecodeCohort, DecodeCohort
from llmsched.core.errors import RequestRejected
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.core.plain_decodes import PlainDecodes
from llmsched.core.scheduler import Scheduler
from llmsched.engine.engine_core import EngineCore
from llmsched.engine.spec_stats import SpecDecodingStats
from llmsched.executor.sim.cost_model import BatchShape, StepCostModel
from llmsched.executor.sim.executor import SimExecutor, StepTiming
from llmsched.sim.loop import Arrivals, Tally
from llmsched.sim.requests import SimRequest
from llmsched.sim.results import StepCosts, StepSeries

# A step that ran nothing: no time of its own.
_IDLE = StepTiming()
# Plain decode steps run at most this many at a time (the loop's other checks run in between).
_PLAIN_RUN = 4096


class OneEngine:
    """Implements the loop's Engines for a single engine."""

    def __init__(
        self,
        sched_config: SchedulerConfig,
        cost_model: StepCostModel,
        arrivals: Arrivals,
        tally: Tally,
        hold: bool,
        fast_forward: bool,
        max_steps: int | None,
    ) -> None:
        self.ex = SimExecutor(cost_model, async_scheduling=sched_config.async_scheduling)
        self.engine = EngineCore(sched_config, self.ex)
        self.sched = self.engine.scheduler
        if self.sched.kv.supports_lazy_registration:
            # Prefix-cache registrations held back until a lookup could hit
            # them (core.kv.deferred): the same decisions, a fraction of the
            # per-prompt hashing and map work.
            self.sched.kv.lazy_registration = True
        # The simulated executor reads no block ids.
        self.sched.list_block_ids = False
        # Policies that read the time (slo) read the virtual clock arrivals use.
        self.sched.clock = self.clock
        if tally.explain:
            self.sched.enable_trace()
        # Proves steps plain decodes and applies them without building their batches.
        self.decodes = PlainDecodes(self.sched)
        self.arrivals = arrivals
        self.tally = tally
        self.costs = StepCosts(sched_config.async_scheduling)
        # Under FCFS the scheduler reads the waiting queue from the head and
        # admits at most max_num_seqs per step, so requests queued behind more
        # than that many cannot affect a step: they are held back (and counted
        # in num_waiting) rather than built.
        self.hold = hold
        self.window = 2 * sched_config.max_num_seqs + 2
        self.plain = fast_forward and not sched_config.async_scheduling
        # Async: plain decode calls run at once (see _async_plain_decodes);
        # a trace or series needs every call's records, so not then.
        self.async_plain = fast_forward and sched_config.async_scheduling
        self.max_steps = max_steps
        # For the trace and series: (loop turn, requests added, requests held
        # back) when each step not yet applied was scheduled, by its step number.
        self.keep = tally.trace_out is not None or tally.series is not None
        # Plain decodes kept lazily across admitting steps (see _cohort_steps);
        # a trace or series needs every step's running requests, so not then.
        self.cohort: DecodeCohort | None = None
        self.use_cohort = self.plain and not self.keep
        # Async: the same across the calls that admit (see _async_cohort_call).
        self.async_cohort: AsyncDecodeCohort | None = None
        self.use_async_cohort = self.async_plain and not self.keep
        self.scheduled_at: dict[int, tuple[int, list | None, int, int]] = {}
        self._decode_results: dict[int, ModelRunnerOutput] = {}
        self.turns = 0
        self.prev_end = -1.0
        self.spec_stats: SpecDecodingStats | None = None

    def use_spec_decode(self, spec_decode: object) -> None:
        """Simulate speculative decoding (a SimSpecDecode) and count its drafts as vLLM does."""
        self.ex.spec = spec_decode
        self.spec_stats = SpecDecodingStats(spec_decode.k)  # type: ignore[attr-defined]

    def clock(self) -> float:
        """The executor's clock."""
        return self.ex.now

    def accepts(self) -> bool:
        """False while the FCFS queue is longer than the scheduler can reach."""
        return not (self.hold and len(self.sched.waiting) >= self.window)

    def add(self, i: int, sent: float, order_t: float, added: list | None) -> None:
        """Build request ``i`` and queue it (a refusal is counted as failed)."""
        req = self.arrivals.build(i, sent, order_t)
        try:
            self.sched.add_request(req)
        except RequestRejected as e:
            self.tally.rejected(req, e)
        else:
            if added is not None:
                added.append(req.request_id)

    def feed(self, added: list | None) -> None:
        """Nothing is routed ahead of time."""

    def has_work(self) -> bool:
        """True while a step would do anything."""
        return self.engine.has_requests()

    def has_held(self) -> bool:
        """Held-back requests are simply not taken yet."""
        return False

    def idle_until(self, t: float) -> None:
        """Jump the clock to the next arrival."""
        self.ex.advance_to(t)

    def step(self, now: float, added: list | None) -> None:
        """One EngineCore.step(), or cohort steps, or plain decode steps; record what was applied."""
        if self.use_cohort and self._cohort_steps():
            return
        if self.use_async_cohort and self._async_cohort_call():
            return
        self.stop_cohort()
        if self.plain and self._plain_decodes():
            return
        if self.async_plain and not self.keep and self._async_plain_decodes():
            return
        engine = self.engine
        es = engine.step()
        arrivals = self.arrivals
        if self.keep and engine.last_scheduled is not None:
            held = arrivals.num_due(now) if self.hold else 0
            self.scheduled_at[engine.last_scheduled.step] = (
                self.turns,
                added,
                held,
                arrivals.in_frontend(now),
            )
        self.turns += 1
        if es is None:
            return  # async: a step put in flight, none applied yet
        tally = self.tally
        tally.num_steps += 1
        so = es.scheduler_output
        accepted = 0
        if self.spec_stats is not None:
            accepted = self.spec_stats.num_accepted_tokens
            self.spec_stats.observe(so, es.model_output)
            accepted = self.spec_stats.num_accepted_tokens - accepted
        timing, end = self._applied_end(so.step)
        self._count_tokens(es.outputs.updated, end, accepted)
        self._tally_finish(es.outputs.finished, end, so.total_num_scheduled_tokens, es.num_running)
        if self.keep:
            at, added_then, held, in_frontend = self.scheduled_at.pop(so.step)
            t = timing if timing is not None else _IDLE
            if tally.series is not None:
                record_step(tally.series, t, end, es.num_running, es.num_waiting + held, es.kv_usage)
            if tally.trace_out is not None:
                rec = step_record(at, es, tally.explain)
                rec["added"] = added_then
                if held:
                    rec["num_waiting"] += held
                    rec["held_back"] = held
                if in_frontend:
                    # Sent, but still being tokenized or passed on by an API server.
                    rec["in_frontend"] = in_frontend
                write_step(tally.trace_out, rec, t, end)

    def _applied_end(self, step: int) -> tuple[StepTiming | None, float]:
        """The applied step's own timing (async: not the batch just scheduled) and when it ended.

        None and the clock's time when it ran nothing and skipped the
        executor; otherwise the engine waited for its output (async) and its
        costs are counted.
        """
        timing = self.ex.timing(step)
        if timing is None:
            return None, self.ex.now
        self.ex.advance_to(timing.end)
        if timing.batch.num_tokens:
            self.costs.add(timing)
        return timing, timing.end

    def _tally_finish(self, finished: Iterable, end: float, num_scheduled: int, num_running: int) -> None:
        """A step's finishes, whether it was busy, and the running high-water mark."""
        tally = self.tally
        for r in finished:
            tally.finished(r, end)
        if num_scheduled:
            tally.num_busy += 1
        if num_running > tally.max_running:
            tally.max_running = num_running

    def _count_tokens(self, samplers: list, end: float, accepted: int = 0, members: int = 0) -> None:
        """Count the tokens of the requests a step gave one (plus ``accepted`` drafts kept).

        ``members``: a cohort step's members, who sampled too, each last at the step before.
        """
        prev_end = self.prev_end
        self.prev_end = end
        if not samplers and not members:
            return
        metrics = self.tally.metrics
        metrics.add_tokens_at(end, members + len(samplers) + accepted)
        add_itl = metrics.add_itl
        same = members
        for r in samplers:
            last = r.last_token_time
            if last < 0.0:
                r.first_token_time = end
            elif last == prev_end:
                same += 1
            else:
                add_itl(end - last)
            r.last_token_time = end
        if same:
            add_itl(end - prev_end, same)

    def _plain_decodes(self) -> int:
        """Run the coming plain decode steps until an arrival is due; how many ran.

        The scheduler proves the steps plain (``plain_decode_steps``) and
        applies them (``advance_decode_steps``); the executor prices and
        clocks each as ``execute()`` would. Every running request sampled at
        the last step's end, so each step adds one token and one gap per
        request, as ``_count_tokens`` counts them; requests the last step
        finishes are counted as ``step()`` counts them.
        """
        sched, ex, tally = self.sched, self.ex, self.tally
        limit = self.max_steps - self.turns if self.max_steps is not None else _PLAIN_RUN
        token = ex.sample_token_id
        # The simulated executor keeps no per-request state, so it never reads finished ids.
        # Without a trace or series, a run may end with the step that finishes requests.
        k = self.decodes.plain_decode_steps(
            token, limit, finished_ids_unread=True, through_finish=not self.keep
        )
        if not k:
            return 0
        running = sched.running
        prev_end = self.prev_end
        ctx = 0
        for r in running:
            if r.last_token_time != prev_end:
                return 0
            ctx += r.num_computed_tokens
        if ex.prices_lora and any(r.lora_id for r in running):
            return 0  # run_decodes prices no adapter products: each step goes through execute()
        d = len(running)
        first = sched.next_step
        start = ex.now
        run = ex.run_decodes(first, d, ctx, k, self.arrivals.next_due_time())
        n = len(run)
        if not n:
            return 0
        self.prev_end = prev_end = tally.metrics.add_steps(run.ends, prev_end, d)
        self.costs.add_serial(run.hosts, run.models)
        finished = None
        if not self.keep:
            finished = self.decodes.advance_decode_steps(n, token)
        else:
            t = StepTiming()
            for j in range(n):
                t0 = time.perf_counter_ns()
                self.decodes.advance_decode_steps(1, token)
                ns = time.perf_counter_ns() - t0
                t.step = first + j
                t.duration = run.totals[j]
                t.host = t.host_gap = run.hosts[j]
                t.model = run.models[j]
                t.batch = BatchShape(d, d, 0, 0, 0, d, ctx + d * (j + 1), 0)
                in_frontend = self.arrivals.in_frontend(run.ends[j - 1] if j else start)
                _record_plain(sched, t, run.ends[j], tally, self.turns + j, ns, in_frontend)
        for r in running:
            r.last_token_time = prev_end
        self._count_plain_run(n, d, finished or (), prev_end)
        return n

    def _async_plain_decodes(self) -> int:
        """Async: run the coming plain decode calls until an arrival is due; how many ran.

        The step in flight must decode every running request one token,
        each having sampled at the last applied step's end; the scheduler
        proves the calls after it plain (``async_plain_decode_steps``) and
        applies them (``advance_async_decode_steps``), the executor clocks
        them as the per-call path would (``run_async_decodes``), and the
        last step they schedule is put in flight for the next call to apply.
        Each call applies one step that gave every running request a token.
        """
        sched, ex, engine = self.sched, self.ex, self.engine
        if len(sched.waiting):
            return 0  # the next call admits
        so = engine.sole_in_flight()
        if so is None or ex.spec is not None or ex.prices_lora:
            return 0
        running = sched.running
        d = len(running)
        scheduled = so.scheduled
        if (
            len(scheduled) != d
            or so.total_num_scheduled_tokens != d
            or sched.next_step != so.step + 1
            or so.preempted
            or so.spec_decode_tokens
        ):
            return 0
        prev_end = self.prev_end
        ctx = 0
        for r, s in zip(running, scheduled):
            if r is not s or r.last_token_time != prev_end:
                return 0
            ctx += r.num_computed_tokens
        limit = self.max_steps - self.turns if self.max_steps is not None else _PLAIN_RUN
        token = ex.sample_token_id
        k = self.decodes.async_plain_decode_steps(token, limit, through_finish=True)
        if not k:
            return 0
        # Does the last call finish some (and so schedule only the rest)?
        last_shape = None
        stays = [r for r in running if r.stop_length - r.num_tokens > k]
        if len(stays) < d:
            d_last = len(stays)
            last_shape = (d_last, sum(r.num_computed_tokens for r in stays) + d_last * k)
        first = sched.next_step
        tally = self.tally
        metrics = tally.metrics
        ends = ex.run_async_decodes(
            first,
            d,
            ctx,
            k,
            self.arrivals.next_due_time(),
            last_shape,
            self.costs,
            metrics.itl_counts(),
            prev_end,
        )
        n = len(ends)
        if not n:
            return 0
        finished = self.decodes.advance_async_decode_steps(n, token, through_finish=n == k)
        running = sched.running
        d_now = len(running)
        last = SchedulerOutput(first + n - 1, list(running), [1] * d_now, d_now)
        engine.replace_in_flight(last, self._decoded(d_now))
        metrics.add_step_tokens(ends, d)
        self.prev_end = end = ends[-1]
        for r in running:
            r.last_token_time = end
        self._count_plain_run(n, d, finished, end)
        return n

    def _cohort_steps(self) -> int:
        """Run the next step, or plain run, with the running requests kept as a DecodeCohort; how many ran.

        While every running request decodes plainly, a step costs only its
        admissions, finishes and block events, not a pass over the batch
        (see ``PlainDecodes.cohort_schedule``); with nothing waiting, the steps
        up to the next finish or arrival run at once. 0 when the step may be
        anything else: the caller then catches the cohort up and builds it.
        """
        cohort = self.cohort
        if cohort is None:
            cohort = self._start_cohort()
            if cohort is None:
                return 0
        if len(self.sched.waiting) or not len(cohort):
            return self._cohort_admitting_step(cohort)
        return self._cohort_plain_run(cohort)

    def _start_cohort(self) -> DecodeCohort | None:
        """A cohort of the running requests, if all sampled at the last step and decode plainly."""
        ex = self.ex
        if ex.spec is not None or ex.prices_lora or ex.vision is not None:
            return None
        prev_end = self.prev_end
        for r in self.sched.running:
            if r.last_token_time != prev_end:
                return None
        self.cohort = self.decodes.start_cohort(ex.sample_token_id)
        return self.cohort

    def stop_cohort(self) -> None:
        """Catch the cohort's requests up (each sampled at the last step's end) and drop it."""
        cohort = self.cohort if self.cohort is not None else self.async_cohort
        if cohort is not None:
            for r in cohort.flush():
                r.last_token_time = self.prev_end
            self.cohort = self.async_cohort = None

    def _cohort_plain_run(self, cohort: DecodeCohort) -> int:
        """Plain decode steps until an arrival is due or a member finishes, counted as ``_plain_decodes``."""
        sched, ex, tally = self.sched, self.ex, self.tally
        d = len(cohort)
        limit = self.max_steps - self.turns if self.max_steps is not None else _PLAIN_RUN
        k = self.decodes.cohort_plain_steps(cohort, limit)
        if not k:
            return 0
        run = ex.run_decodes(sched.next_step, d, cohort.context(), k, self.arrivals.next_due_time())
        n = len(run)
        if not n:
            return 0
        self.prev_end = end = tally.metrics.add_steps(run.ends, self.prev_end, d)
        self.costs.add_serial(run.hosts, run.models)
        self._count_plain_run(n, d, self.decodes.advance_cohort(cohort, n), end)
        return n

    def _count_plain_run(self, n: int, d: int, finished: Iterable[SimRequest], end: float) -> None:
        """Count ``n`` plain steps of ``d`` decodes, the last ending at ``end`` and finishing ``finished``."""
        tally = self.tally
        for r in finished:
            # As step() counts a step's finished requests (running may have lost them already).
            r.last_token_time = end
            tally.finished(r, end)
        self.turns += n
        tally.num_steps += n
        tally.num_busy += n
        if d > tally.max_running:
            tally.max_running = d

    def _cohort_admitting_step(self, cohort: DecodeCohort) -> int:
        """One step: the cohort decodes, the queue is admitted; counted as ``step()`` counts a built one."""
        sched, tally = self.sched, self.tally
        if self.max_steps is not None and self.turns >= self.max_steps:
            return 0
        d = len(cohort)
        context = cohort.context()
        got = self.decodes.cohort_schedule(cohort)
        if got is None:
            return 0
        out, finishing = got
        num_running = len(sched.running)
        timing = self.ex.execute_with_decodes(out, d, context + d)
        end = timing.end
        if timing.batch.num_tokens:
            self.costs.add(timing)
        samplers, finished = self.decodes.cohort_update(cohort, out, finishing)
        self._count_tokens(samplers, end, members=d)
        for r in finished:
            r.last_token_time = end
        self.turns += 1
        tally.num_steps += 1
        self._tally_finish(finished, end, out.total_num_scheduled_tokens, num_running)
        return 1

    def _async_cohort_call(self) -> int:
        """Async: one engine call, or a run of plain calls, with the running requests kept as a cohort.

        While requests wait, or the ones admitted last call take their first
        decodes behind the members, a call costs those requests, the
        members' block events and finishes, not a pass over the batch (see
        ``PlainDecodes.async_cohort_schedule``); when nothing waits and all
        that runs is the cohort, its plain calls run together
        (``_async_cohort_plain_run``). Returns the calls run; 0 when the
        call may be anything else: the caller then catches the cohort up.
        """
        sched = self.sched
        cohort = self.async_cohort
        if cohort is None:
            cohort = self._start_async_cohort()
            if cohort is None:
                return 0
        if not len(sched.waiting) and len(sched.running) == len(cohort):
            return self._async_cohort_plain_run(cohort)
        if self.max_steps is not None and self.turns >= self.max_steps:
            return 0
        got = self.decodes.async_cohort_schedule(cohort)
        if got is None:
            return 0
        out, finishing, decodes, context = got
        ex, engine, tally = self.ex, self.engine, self.tally
        counts = (len(sched.running), sched.num_waiting, sched.kv.usage)
        result = ex.execute_after_decodes(out, decodes, context)
        so, prev_result, num_running = engine.swap_in_flight(out, result, *counts)
        samplers, members, finished = self.decodes.async_cohort_update(
            cohort, so, prev_result, finishing, decodes
        )
        # As step() counts the step applied.
        _, end = self._applied_end(so.step)
        self._count_tokens(samplers, end, members=members)
        for r in finished:
            r.last_token_time = end
        self.turns += 1
        tally.num_steps += 1
        self._tally_finish(finished, end, so.total_num_scheduled_tokens, num_running)
        return 1

    def _async_cohort_plain_run(self, cohort: AsyncDecodeCohort) -> int:
        """Plain decode calls of the cohort until an arrival is due, counted as ``_async_plain_decodes``."""
        sched, ex, tally = self.sched, self.ex, self.tally
        limit = self.max_steps - self.turns if self.max_steps is not None else _PLAIN_RUN
        k = self.decodes.async_cohort_plain_calls(cohort, limit)
        if not k:
            return 0
        d = len(cohort)
        steps = cohort.steps
        context = cohort.sum_offset + d * steps
        finishing = cohort.finishing(k - 1)
        last_shape = None
        if finishing:
            d_last = d - len(finishing)
            stays = cohort.sum_offset - sum(cohort.offset_of(r) for r in finishing)
            last_shape = (d_last, stays + d_last * (steps + k))
        metrics = tally.metrics
        ends = ex.run_async_decodes(
            sched.next_step,
            d,
            context,
            k,
            self.arrivals.next_due_time(),
            last_shape,
            self.costs,
            metrics.itl_counts(),
            self.prev_end,
        )
        n = len(ends)
        if not n:
            return 0
        last = self.decodes.advance_async_cohort(cohort, n, finishing if n == k else [])
        d_now = len(last.scheduled)
        self.engine.replace_in_flight(last, self._decoded(d_now))
        metrics.add_step_tokens(ends, d)
        self.prev_end = end = ends[-1]
        self._count_plain_run(n, d, finishing if n == k else (), end)
        return n

    def _decoded(self, d: int) -> ModelRunnerOutput:
        """The executor's output for ``d`` one-token decodes (read-only, so one per size is kept)."""
        result = self._decode_results.get(d)
        if result is None:
            result = self._decode_results[d] = ModelRunnerOutput(
                sampled_token_ids=[(self.ex.sample_token_id,)] * d
            )
        return result

    def _start_async_cohort(self) -> AsyncDecodeCohort | None:
        """A cohort of the running requests, if the step in flight decodes them all and all sampled last."""
        ex = self.ex
        if ex.spec is not None or ex.prices_lora or ex.vision is not None:
            return None
        so = self.engine.sole_in_flight()
        if so is None:
            return None
        prev_end = self.prev_end
        for r in self.sched.running:
            if r.last_token_time != prev_end:
                return None
        self.async_cohort = self.decodes.start_async_cohort(ex.sample_token_id, so)
        return self.async_cohort

    def result_fields(self) -> dict:
        """SimResult's fields that come from the engine."""
        self.stop_cohort()
        sched = self.sched
        return {
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_hit_rate": sched.prefix_cache_stats.hit_rate,
            "sim_duration_s": self.ex.now,
            "step_costs": self.costs,
            "spec_decode": spec_dict(self.spec_stats) if self.spec_stats is not None else None,
        }


def spec_dict(stats: SpecDecodingStats) -> dict:
    """Speculative decoding's counters and rates (vLLM's definitions)."""
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "accepted_per_position": list(stats.accepted_per_pos),
    }


def _record_plain(
    sched: Scheduler, t: StepTiming, end: float, tally: Tally, turn: int, ns: int, in_frontend: int
) -> None:
    """The series point and trace line of a plain decode step, as a built step would give them."""
    running = sched.running
    d = len(running)
    if tally.series is not None:
        record_step(tally.series, t, end, d, 0, sched.kv_usage)
    trace_out = tally.trace_out
    if trace_out is not None:
        rec = {
            "step": turn,
            "sched": [[r.request_id, 1] for r in running],
            "admitted": [],
            "preempted": [],
            "finished": [],
            "total_tokens": d,
            "num_running": d,
            "num_waiting": 0,
            "kv_usage": round(sched.kv_usage, 6),
            "schedule_ns": ns,
            "update_ns": 0,
            "added": [],
        }
        if in_frontend:
            rec["in_frontend"] = in_frontend
        write_step(trace_out, rec, t, end)


def write_step(out: IO[str], rec: dict, t: StepTiming, end: float) -> None:
    """A step's trace line: the scheduler's record, then its simulated timing."""
    rec["sim_time_s"] = round(end - t.duration, 9)
    rec["sim_duration_s"] = round(t.duration, 9)
    rec["sim_host_s"] = round(t.host, 9)
    rec["sim_model_s"] = round(t.model, 9)
    rec["sim_host_gap_s"] = round(t.host_gap, 9)
    out.write(json.dumps(rec, separators=(",", ":")) + "\n")


def record_step(
    series: StepSeries, t: StepTiming, end: float, num_running: int, num_waiting: int, kv_usage: float
) -> None:
    """One point of the series: the applied step's state when scheduled, its timing."""
    b = t.batch
    series.time.append(end - t.duration)
    series.duration.append(t.duration)
    series.num_running.append(num_running)
    series.num_waiting.append(num_waiting)
    series.kv_usage.append(kv_usage)
    series.prefill_tokens.append(b.prefill_tokens)
    series.decode_tokens.append(b.num_decodes)
    series.host.append(t.host)
    series.model.append(t.model)
    series.host_gap.append(t.host_gap)
