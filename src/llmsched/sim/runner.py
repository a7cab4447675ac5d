"""The simulation loop: arrivals on the virtual clock, the real engine, metrics.

Each iteration adds every request whose arrival time the clock has passed
(and, with ``max_concurrency``, for which a client slot is free), then runs
one ``EngineCore.step()``: the unmodified scheduler decides the batch and
the SimExecutor prices it and advances the clock. An idle engine jumps to
the next arrival. Requests are created when they arrive and dropped when
they finish, and under FCFS a waiting queue longer than the scheduler can
reach in one step is held back unbuilt, so memory stays bounded by the
requests in flight even when a million arrive at once.

With async scheduling (``SchedulerConfig.async_scheduling``) a call
schedules one step and applies the one before it. The executor keeps each
executed batch's timing (``StepTiming``): a step's tokens, finishes and
trace line are timed by that step's own forward end, when the engine
applies it, and the clock moves to that end then (the engine waits for the
step's output). Trace lines carry the loop turn at which the step was
scheduled and the requests added before it, as ``llmsched replay`` writes
them for an async workload.
"""

from __future__ import annotations

import gc
import json
import math
import time
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

import llmsched
from llmsched.bench.metrics import DEFAULT_PERCENTILES, MetricsCollector, format_summary, percentile_sorted
from llmsched.bench.replay import step_record
from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import RequestRejected
from llmsched.core.request import Request
from llmsched.core.sampling_params import SamplingParams
from llmsched.core.scheduler import Scheduler
from llmsched.engine.engine_core import EngineCore
from llmsched.executor.sim.cost_model import BatchShape, StepCostModel
from llmsched.executor.sim.executor import SimExecutor, StepTiming
from llmsched.sim.deployment import Deployment
from llmsched.sim.workload import Workload

if TYPE_CHECKING:
    from tqdm import tqdm

# Progress-bar updates are batched: tqdm costs a few microseconds per call.
_PROGRESS_EVERY = 64
# Failed requests whose reason is kept for the report.
_MAX_REJECTIONS_KEPT = 20


class SimRequest(Request):
    """A Request that also carries its client-side timestamps on the virtual clock."""

    __slots__ = ("first_token_time", "last_token_time", "sent_time")

    def __init__(self, *args: object, sent_time: float = 0.0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.sent_time = sent_time
        self.first_token_time = -1.0
        self.last_token_time = -1.0


@dataclass(slots=True)
class StepSeries:
    """Per-step state over simulated time (for plots)."""

    time: array = field(default_factory=lambda: array("d"))
    duration: array = field(default_factory=lambda: array("d"))
    num_running: array = field(default_factory=lambda: array("l"))
    num_waiting: array = field(default_factory=lambda: array("l"))
    kv_usage: array = field(default_factory=lambda: array("d"))
    prefill_tokens: array = field(default_factory=lambda: array("l"))
    decode_tokens: array = field(default_factory=lambda: array("l"))
    # The step's host path, model time and the device's wait for the host
    # (see StepTiming), seconds; 0 for a step that ran no tokens.
    host: array = field(default_factory=lambda: array("d"))
    model: array = field(default_factory=lambda: array("d"))
    host_gap: array = field(default_factory=lambda: array("d"))

    def __len__(self) -> int:
        return len(self.time)


@dataclass(slots=True)
class StepCosts:
    """Host path and model time summed over the steps that ran tokens, and the device's waits."""

    async_scheduling: bool = False
    num_steps: int = 0
    host_s: float = 0.0
    model_s: float = 0.0
    host_gap_s: float = 0.0
    # Per step, for percentiles.
    host_gaps: array = field(default_factory=lambda: array("d"))

    def add_serial(self, hosts: Sequence[float], models: Sequence[float]) -> None:
        """Count executed sync steps by their parts (a sync step's host gap is its host path)."""
        host_s, model_s, gap_s = self.host_s, self.model_s, self.host_gap_s
        for h, m in zip(hosts, models):
            host_s += h
            model_s += m
            gap_s += h
        self.host_s, self.model_s, self.host_gap_s = host_s, model_s, gap_s
        self.num_steps += len(hosts)
        self.host_gaps.extend(hosts)

    def add(self, t: StepTiming) -> None:
        """Count one executed step with tokens."""
        self.num_steps += 1
        self.host_s += t.host
        self.model_s += t.model
        self.host_gap_s += t.host_gap
        self.host_gaps.append(t.host_gap)

    def to_dict(self, duration: float) -> dict:
        """Totals (s), per-step means and host-gap percentiles (ms), the device's busy share."""
        n = self.num_steps or 1
        gaps = sorted(self.host_gaps)
        return {
            "async_scheduling": self.async_scheduling,
            "num_steps": self.num_steps,
            "host_s": self.host_s,
            "model_s": self.model_s,
            "host_gap_s": self.host_gap_s,
            "mean_host_ms": 1e3 * self.host_s / n,
            "mean_model_ms": 1e3 * self.model_s / n,
            "mean_host_gap_ms": 1e3 * self.host_gap_s / n,
            "median_host_gap_ms": 1e3 * percentile_sorted(gaps, 50.0),
            "p99_host_gap_ms": 1e3 * percentile_sorted(gaps, 99.0),
            "model_busy_fraction": self.model_s / duration if duration > 0 else 0.0,
        }

    def rows(self) -> list[tuple[str, object]]:
        """Summary-table rows."""
        d = self.to_dict(0.0)
        return [
            ("Async scheduling:", "on" if self.async_scheduling else "off"),
            ("Mean host path / model per step (ms):", f"{d['mean_host_ms']:.3f} / {d['mean_model_ms']:.3f}"),
            ("Host gap median / p99 (ms):", f"{d['median_host_gap_ms']:.3f} / {d['p99_host_gap_ms']:.3f}"),
        ]


@dataclass(slots=True)
class SimResult:
    """What a simulation produced."""

    metrics: MetricsCollector
    summary: dict
    num_requests: int
    num_steps: int
    num_busy_steps: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    max_running: int
    num_length_capped: int
    sim_duration_s: float
    wall_s: float
    rejections: list[tuple[str, str]]
    series: StepSeries | None = None
    deployment: Deployment | None = None
    workload_description: str = ""
    max_concurrency: int | None = None
    request_rate: float = math.inf
    percentiles: Sequence[float] = DEFAULT_PERCENTILES
    # Data-parallel runs: mode, policies and per-rank figures (see dp_runner).
    data_parallel: dict | None = None
    # Single-engine runs: host path and model time of the steps.
    step_costs: StepCosts | None = None

    @property
    def wall_us_per_request(self) -> float:
        """Wall time the simulation took per request."""
        return self.wall_s * 1e6 / max(self.num_requests, 1)

    def scheduler_rows(self) -> list[tuple[str, object]]:
        """Scheduler figures for the summary table."""
        rows: list[tuple[str, object]] = [
            ("Engine steps (with tokens):", f"{self.num_steps} ({self.num_busy_steps})"),
            ("Preemptions:", self.num_preemptions),
            ("Prefix cache hit rate (%):", 100.0 * self.prefix_cache_hit_rate),
            ("Max running requests:", self.max_running),
        ]
        if self.num_length_capped:
            rows.append(("Outputs cut at max_model_len:", self.num_length_capped))
        if self.data_parallel is not None:
            rows.extend(self.data_parallel.get("rows", []))
        if self.step_costs is not None:
            rows.extend(self.step_costs.rows())
        rows.append(
            ("Simulated in (s wall):", f"{self.wall_s:.2f} ({self.wall_us_per_request:.1f} us/request)")
        )
        return rows

    def table(self) -> str:
        """vLLM-style result table plus the scheduler's figures."""
        return format_summary(
            self.summary,
            title="Simulation Result",
            percentiles=self.percentiles,
            extra=self.scheduler_rows(),
            request_rate=self.request_rate,
            max_concurrency=self.max_concurrency,
        )

    def to_json(self) -> dict:
        """vLLM result keys, then the simulation's own figures and the deployment."""
        out = dict(self.summary)
        out["request_rate"] = self.request_rate if not math.isinf(self.request_rate) else "inf"
        out["max_concurrency"] = self.max_concurrency
        out["num_prompts"] = self.num_requests
        out["simulation"] = {
            "num_steps": self.num_steps,
            "num_busy_steps": self.num_busy_steps,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "max_running": self.max_running,
            "num_length_capped": self.num_length_capped,
            "sim_duration_s": self.sim_duration_s,
            "wall_s": self.wall_s,
            "wall_us_per_request": self.wall_us_per_request,
            "workload": self.workload_description,
            "rejections": [list(r) for r in self.rejections],
        }
        if self.data_parallel is not None:
            out["simulation"]["data_parallel"] = {k: v for k, v in self.data_parallel.items() if k != "rows"}
        if self.step_costs is not None:
            out["simulation"]["async_scheduling"] = self.step_costs.async_scheduling
            out["simulation"]["step_costs"] = self.step_costs.to_dict(self.sim_duration_s)
        if self.deployment is not None:
            out["deployment"] = self.deployment.to_dict()
        return out


def simulate(
    config: SchedulerConfig | Deployment,
    workload: Workload,
    cost_model: StepCostModel | None = None,
    *,
    max_concurrency: int | None = None,
    goodput_slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    trace_out: IO[str] | None = None,
    explain: bool = False,
    record_series: bool = False,
    progress: bool = False,
    detailed: bool = False,
    max_steps: int | None = None,
    hold_back: bool = True,
    fast_forward: bool = True,
) -> SimResult:
    """Run ``workload`` through the engine on a virtual clock and measure it.

    ``config`` is a resolved Deployment (its scheduler config and cost model
    are used) or a bare SchedulerConfig together with ``cost_model``. The
    config's ``async_scheduling`` picks the engine loop and how a step's
    host path and model time combine (see SimExecutor). ``fast_forward``
    applies plain decode steps (see ``Scheduler.plain_decode_steps``)
    without building their batches: the same steps, trace and figures.
    """
    deployment, sched_config, cost_model = resolve_run(config, cost_model, max_concurrency, "simulate")
    ex = SimExecutor(cost_model, async_scheduling=sched_config.async_scheduling)
    engine = EngineCore(sched_config, ex)
    sched = engine.scheduler
    if explain:
        sched.enable_trace()
    if trace_out is not None:
        write_header(trace_out, sched_config, len(workload), deployment, cost_model)

    n = len(workload)
    arrivals = workload.arrivals
    # Under FCFS the scheduler reads the waiting queue from the head and
    # admits at most max_num_seqs per step, so requests queued behind more
    # than that many cannot affect a step: they are held back (and counted
    # in num_waiting) rather than built, which bounds memory when a million
    # requests arrive at once. Priority order needs them all; so does
    # --explain, which lists the queue.
    hold = hold_back and max_concurrency is None and sched_config.policy == "fcfs" and not explain
    window = 2 * sched_config.max_num_seqs + 2
    waiting = sched.waiting
    out_lens = workload.output_lens
    prios = workload.priorities
    metrics = MetricsCollector()
    add_itl = metrics.add_itl
    series = StepSeries() if record_series else None
    costs = StepCosts(sched_config.async_scheduling)
    # For the trace and series: (loop turn, requests added, requests held
    # back) when each step not yet applied was scheduled, by its step number.
    keep = trace_out is not None or series is not None
    # Plain decode steps are run without building their batches (sync only).
    plain = fast_forward and not sched_config.async_scheduling
    scheduled_at: dict[int, tuple[int, list[str] | None, int]] = {}
    slots: deque[float] | None = deque([0.0] * max_concurrency) if max_concurrency else None
    params: dict[int, SamplingParams] = {}
    rejections: list[tuple[str, str]] = []
    bar = _progress_bar(n, progress)
    done_pending = 0
    nxt = 0
    last_arrival = -math.inf
    prev_end = -1.0
    num_steps = num_busy = max_running = capped = turn = 0
    gc_was_enabled = gc.isenabled()
    # The loop allocates many short-lived objects and no cycles; the cyclic
    # collector would only rescan the live requests' token lists over and over
    # (it is restored below, whatever happens).
    gc.disable()
    t_wall = time.perf_counter()
    try:
        while True:
            now = ex.now
            added: list[str] | None = [] if trace_out is not None else None
            while nxt < n:
                t_arr = arrivals[nxt]
                if t_arr > now or (hold and len(waiting) >= window):
                    break
                if slots is not None:
                    if not slots:
                        break
                    free_at = slots.popleft()
                    sent = t_arr if t_arr > free_at else free_at
                else:
                    sent = t_arr
                out_len = out_lens[nxt]
                sp = params.get(out_len)
                if sp is None:
                    sp = params[out_len] = SamplingParams(max_tokens=out_len, ignore_eos=True)
                # The scheduler breaks priority ties by arrival time: keep it
                # strictly increasing in arrival order, as wall-clock arrivals are.
                order_t = sent if sent > last_arrival else math.nextafter(last_arrival, math.inf)
                last_arrival = order_t
                rid = workload.request_id(nxt)
                req = SimRequest(
                    rid,
                    workload.prompt(nxt),
                    sp,
                    priority=prios[nxt] if prios is not None else 0,
                    arrival_time=order_t,
                    sent_time=sent,
                )
                try:
                    sched.add_request(req)
                except RequestRejected as e:
                    metrics.add_failed(req.num_prompt_tokens)
                    done_pending += 1
                    if len(rejections) < _MAX_REJECTIONS_KEPT:
                        rejections.append((rid, str(e)))
                    if slots is not None:
                        slots.appendleft(sent)
                else:
                    if added is not None:
                        added.append(rid)
                nxt += 1
            if not engine.has_requests():
                if nxt >= n:
                    break
                ex.advance_to(arrivals[nxt])
                continue
            if max_steps is not None and turn >= max_steps:
                break
            if plain:
                limit = max_steps - turn if max_steps is not None else _PLAIN_RUN
                free = nxt < n and (slots is None or bool(slots))
                k, prev_end = _plain_decodes(
                    engine,
                    ex,
                    limit,
                    arrivals[nxt] if free else math.inf,
                    prev_end,
                    metrics,
                    costs,
                    series,
                    trace_out,
                    turn,
                )
                if k:
                    num_steps += k
                    num_busy += k
                    turn += k
                    if len(sched.running) > max_running:
                        max_running = len(sched.running)
                    continue
            es = engine.step()
            if keep and engine.last_scheduled is not None:
                held = bisect_right(arrivals, now, nxt) - nxt if hold and nxt < n else 0
                scheduled_at[engine.last_scheduled.step] = (turn, added, held)
            turn += 1
            if es is None:
                continue  # async: a step put in flight, none applied yet
            num_steps += 1
            so = es.scheduler_output
            # The applied step's own timing (async: not the batch just
            # scheduled); None when it ran nothing and skipped the executor.
            timing = ex.timing(so.step)
            if timing is not None:
                end = timing.end
                # Async: the engine waited for this step's output.
                ex.advance_to(end)
                if timing.batch.num_tokens:
                    costs.add(timing)
            else:
                end = ex.now
            # The requests this step's output gave a token: what it sampled,
            # less (async) the tokens of requests that finished meanwhile.
            samplers = es.outputs.updated
            if samplers:
                metrics.add_tokens_at(end, len(samplers))
                same = 0
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
            prev_end = end
            finished = es.outputs.finished
            if finished:
                for r in finished:
                    capped += record_finish(metrics, r, end, slots)
                done_pending += len(finished)
            if so.total_num_scheduled_tokens:
                num_busy += 1
            if es.num_running > max_running:
                max_running = es.num_running
            if keep:
                at, added_then, held = scheduled_at.pop(so.step)
                t = timing if timing is not None else _IDLE
                if series is not None:
                    _record_step(series, t, end, es.num_running, es.num_waiting + held, es.kv_usage)
                if trace_out is not None:
                    rec = step_record(at, es, explain)
                    rec["added"] = added_then
                    if held:
                        rec["num_waiting"] += held
                        rec["held_back"] = held
                    _write_step(trace_out, rec, t, end)
            if bar is not None and done_pending and num_steps % _PROGRESS_EVERY == 0:
                bar.update(done_pending)
                done_pending = 0
    finally:
        wall = time.perf_counter() - t_wall
        if gc_was_enabled:
            gc.enable()
        if bar is not None:
            bar.update(done_pending)
            bar.close()
    duration = ex.now
    summary = metrics.summary(duration, goodput_slos_ms, percentiles, detailed=detailed)
    return SimResult(
        metrics=metrics,
        summary=summary,
        num_requests=n,
        num_steps=num_steps,
        num_busy_steps=num_busy,
        num_preemptions=sched.num_preemptions,
        prefix_cache_hit_rate=sched.prefix_cache_stats.hit_rate,
        max_running=max_running,
        num_length_capped=capped,
        sim_duration_s=duration,
        wall_s=wall,
        rejections=rejections,
        series=series,
        deployment=deployment,
        workload_description=workload.describe(),
        max_concurrency=max_concurrency,
        request_rate=workload.request_rate,
        percentiles=percentiles,
        step_costs=costs,
    )


# A step that ran nothing: no time of its own.
_IDLE = StepTiming()


# Plain decode steps run at most this many at a time (the loop's other checks run in between).
_PLAIN_RUN = 4096


def _plain_decodes(
    engine: EngineCore,
    ex: SimExecutor,
    limit: int,
    next_arrival: float,
    prev_end: float,
    metrics: MetricsCollector,
    costs: StepCosts,
    series: StepSeries | None,
    trace_out: IO[str] | None,
    turn: int,
) -> tuple[int, float]:
    """Run the coming plain decode steps until an arrival is due; (steps run, the last one's end).

    The scheduler proves the steps plain (``plain_decode_steps``) and
    applies them (``advance_decode_steps``); the executor prices and clocks
    each as ``execute()`` would. Every running request sampled at
    ``prev_end``, so each step adds one token and one gap per request, as
    the loop counts them.
    """
    sched = engine.scheduler
    token = ex.sample_token_id
    k = sched.plain_decode_steps(token, limit)
    running = sched.running
    if not k or any(r.last_token_time != prev_end for r in running):
        return 0, prev_end
    d = len(running)
    ctx = 0
    for r in running:
        ctx += r.num_computed_tokens
    first = sched.next_step
    run = ex.run_decodes(first, d, ctx, k, next_arrival)
    n = len(run)
    prev_end = metrics.add_steps(run.ends, prev_end, d)
    costs.add_serial(run.hosts, run.models)
    if trace_out is None and series is None:
        sched.advance_decode_steps(n, token)
    else:
        t = StepTiming()
        for j in range(n):
            t0 = time.perf_counter_ns()
            sched.advance_decode_steps(1, token)
            ns = time.perf_counter_ns() - t0
            t.step = first + j
            t.duration = run.totals[j]
            t.host = t.host_gap = run.hosts[j]
            t.model = run.models[j]
            t.batch = BatchShape(d, d, 0, 0, 0, d, ctx + d * (j + 1), 0)
            _record_plain(sched, t, run.ends[j], series, trace_out, turn + j, ns)
    for r in running:
        r.last_token_time = prev_end
    return n, prev_end


def _record_plain(
    sched: Scheduler,
    t: StepTiming,
    end: float,
    series: StepSeries | None,
    trace_out: IO[str] | None,
    turn: int,
    ns: int,
) -> None:
    """The series point and trace line of a plain decode step, as a built step would give them."""
    running = sched.running
    d = len(running)
    if series is not None:
        _record_step(series, t, end, d, 0, sched.kv_usage)
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
        _write_step(trace_out, rec, t, end)


def _write_step(out: IO[str], rec: dict, t: StepTiming, end: float) -> None:
    """A step's trace line: the scheduler's record, then its simulated timing."""
    rec["sim_time_s"] = round(end - t.duration, 9)
    rec["sim_duration_s"] = round(t.duration, 9)
    rec["sim_host_s"] = round(t.host, 9)
    rec["sim_model_s"] = round(t.model, 9)
    rec["sim_host_gap_s"] = round(t.host_gap, 9)
    out.write(json.dumps(rec, separators=(",", ":")) + "\n")


def _record_step(
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


def resolve_run(
    config: SchedulerConfig | Deployment,
    cost_model: StepCostModel | None,
    max_concurrency: int | None,
    caller: str,
) -> tuple[Deployment | None, SchedulerConfig, StepCostModel]:
    """The deployment (if any), scheduler config and cost model a simulation runs with."""
    deployment = config if isinstance(config, Deployment) else None
    if deployment is not None:
        sched_config = deployment.scheduler_config
        cost_model = cost_model or deployment.cost_model
    else:
        sched_config = config
        if cost_model is None:
            raise ValueError(f"{caller}() needs a cost_model with a bare SchedulerConfig")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
    return deployment, sched_config, cost_model


def write_header(
    out: IO[str],
    sched_config: SchedulerConfig,
    num_requests: int,
    deployment: Deployment | None,
    cost_model: StepCostModel,
    **extra: object,
) -> None:
    """The step trace's first line: version, resolved config, the simulated deployment."""
    header = {
        "llmsched_version": llmsched.__version__,
        "resolved": sched_config.to_dict(),
        "num_requests": num_requests,
        **extra,
        "simulator": deployment.to_dict() if deployment is not None else {"cost_model": repr(cost_model)},
    }
    out.write(json.dumps({"header": header}) + "\n")


def record_finish(metrics: MetricsCollector, r: SimRequest, end: float, slots: deque[float] | None) -> int:
    """Count a finished request's latencies, free its client slot; 1 if max_model_len cut it short."""
    metrics.add_request(r.sent_time, r.first_token_time, end, r.num_prompt_tokens, r.num_output_tokens)
    if slots is not None:
        slots.append(end)
    return 1 if r.num_tokens - r.num_prompt_tokens < r.max_tokens else 0


def _progress_bar(total: int, enabled: bool) -> tqdm | None:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: tqdm shows itself only on a terminal.
    return tqdm(total=total, unit="req", desc="simulating", disable=None, mininterval=0.5)
