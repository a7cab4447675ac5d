"""The simulation loop for a data-parallel deployment: N ranks behind one router, one virtual clock.

Arrivals go through the DP front end (least-loaded routing) to the ranks
of a SimTransport; each iteration runs one lock-step of every rank (or, for
independent ranks, one step of the rank furthest behind). Metrics are the
single-engine simulator's, measured at the client across all ranks.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import IO

from llmsched.bench.metrics import DEFAULT_PERCENTILES, MetricsCollector
from llmsched.bench.replay import step_record
from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import RequestRejected
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.dp.config import DPConfig
from llmsched.engine.dp.engine import DPEngine
from llmsched.engine.dp.sim_transport import DEFAULT_SYNC_S, SimTransport
from llmsched.executor.sim.cost_model import (
    LAUNCH_EAGER,
    LAUNCH_GRAPH,
    LAUNCH_MODE_NAMES,
    LAUNCH_PIECEWISE,
    StepCostModel,
)
from llmsched.sim.deployment import Deployment
from llmsched.sim.runner import (
    SimRequest,
    SimResult,
    StepSeries,
    _progress_bar,
    record_finish,
    resolve_run,
    write_header,
)
from llmsched.sim.workload import Workload

_PROGRESS_EVERY = 64
_MAX_REJECTIONS_KEPT = 20


def simulate_dp(
    config: SchedulerConfig | Deployment,
    workload: Workload,
    dp: DPConfig,
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
    sync_s: float = DEFAULT_SYNC_S,
    hold_back: bool = True,
) -> SimResult:
    """Run ``workload`` through ``dp.data_parallel_size`` simulated ranks and measure it.

    ``config`` is a resolved Deployment (its per-rank scheduler config and
    cost model are used) or a bare per-rank SchedulerConfig with ``cost_model``.
    Under FCFS a request is routed when it arrives but built only once its
    rank's queue is short enough for the scheduler to reach it (as the
    single-engine loop holds requests back), so memory stays bounded.
    """
    deployment, sched_config, cost_model = resolve_run(config, cost_model, max_concurrency, "simulate_dp")
    sched_config = replace(sched_config, prefill_schedule_interval=dp.rank_prefill_interval)
    transport = SimTransport(sched_config, cost_model, dp, sync_s=sync_s)
    engine = DPEngine(transport, keep_results=False)
    ranks = transport.ranks
    if explain:
        for r in ranks:
            r.scheduler.enable_trace()
    if trace_out is not None:
        dp_info = _dp_dict(dp)
        write_header(trace_out, sched_config, len(workload), deployment, cost_model, data_parallel=dp_info)

    n = len(workload)
    arrivals = workload.arrivals
    out_lens = workload.output_lens
    prios = workload.priorities
    metrics = MetricsCollector()
    add_itl = metrics.add_itl
    series = StepSeries() if record_series else None
    slots: deque[float] | None = deque([0.0] * max_concurrency) if max_concurrency else None
    params: dict[int, SamplingParams] = {}
    rejections: list[tuple[str, str]] = []
    live: dict[str, SimRequest] = {}
    # Routed but not yet built, per rank: (workload index, sent, order time).
    hold = hold_back and max_concurrency is None and sched_config.policy == "fcfs" and not explain
    window = 2 * sched_config.max_num_seqs + 2
    deferred: list[deque[tuple[int, float, float]]] = [deque() for _ in ranks]
    added: list[list] | None = None

    def build(i: int, sent: float, order_t: float) -> SimRequest:
        """Workload request i, built now (its prompt included)."""
        out_len = out_lens[i]
        sp = params.get(out_len)
        if sp is None:
            sp = params[out_len] = SamplingParams(max_tokens=out_len, ignore_eos=True)
        return SimRequest(
            workload.request_id(i),
            workload.prompt(i),
            sp,
            priority=prios[i] if prios is not None else 0,
            arrival_time=order_t,
            sent_time=sent,
        )

    def admit(req: SimRequest, rank: int | None) -> None:
        """Hand a request to the front end (to ``rank`` if already routed); count a rejection."""
        nonlocal done_pending
        try:
            rank = engine.add_request(req, rank)
        except RequestRejected as e:
            metrics.add_failed(req.num_prompt_tokens)
            done_pending += 1
            if len(rejections) < _MAX_REJECTIONS_KEPT:
                rejections.append((req.request_id, str(e)))
            if slots is not None:
                slots.appendleft(req.sent_time)
        else:
            live[req.request_id] = req
            if added is not None:
                added.append([req.request_id, rank])

    bar = _progress_bar(n, progress)
    done_pending = 0
    nxt = 0
    last_arrival = -math.inf
    num_steps = num_busy = max_running = capped = 0
    gc_was_enabled = gc.isenabled()
    # As in the single-engine loop: many short-lived objects, no cycles.
    gc.disable()
    t_wall = time.perf_counter()
    try:
        while True:
            now = transport.next_step_time()
            if math.isinf(now):
                now = transport.now
            added = [] if trace_out is not None else None
            while nxt < n:
                t_arr = arrivals[nxt]
                if t_arr > now:
                    break
                if slots is not None:
                    if not slots:
                        break
                    free_at = slots.popleft()
                    sent = t_arr if t_arr > free_at else free_at
                else:
                    sent = t_arr
                transport.advance_to(sent)
                order_t = sent if sent > last_arrival else math.nextafter(last_arrival, math.inf)
                last_arrival = order_t
                if hold:
                    deferred[engine.route()].append((nxt, sent, order_t))
                else:
                    admit(build(nxt, sent, order_t), None)
                nxt += 1
            if hold:
                for rank, queue in enumerate(deferred):
                    waiting = ranks[rank].scheduler.waiting
                    while queue and len(waiting) < window:
                        admit(build(*queue.popleft()), rank)
            if not transport.has_work():
                if any(deferred):
                    continue  # fed to their ranks on the next pass
                if nxt >= n:
                    break
                if slots is not None and not slots:
                    raise AssertionError("no client slot is free while no request runs")
                transport.advance_to(arrivals[nxt])
                continue
            if max_steps is not None and num_steps >= max_steps:
                break
            reports = engine.step()
            num_steps += 1
            group_running = 0
            busy = False
            for rep in reports:
                end = rep.time
                group_running += rep.num_running
                busy = busy or rep.executed
                # Tokens of one report share their time, and mostly their gap: count them together.
                tokens = 0
                gaps: dict[float, int] = {}
                for out in rep.outputs:
                    r = live.get(out.request_id)
                    if r is None:
                        continue
                    k = len(out.new_token_ids)
                    if k:
                        tokens += k
                        last = r.last_token_time
                        if last < 0.0:
                            r.first_token_time = end
                        else:
                            gap = end - last
                            gaps[gap] = gaps.get(gap, 0) + 1
                        r.last_token_time = end
                    if out.finish_reason is not None:
                        del live[out.request_id]
                        capped += record_finish(metrics, r, end, slots)
                        done_pending += 1
                if tokens:
                    metrics.add_tokens_at(end, tokens)
                for gap, count in gaps.items():
                    add_itl(gap, count)
                if trace_out is not None and rep.engine_step is not None:
                    es = rep.engine_step
                    rec = step_record(es.scheduler_output.step, es, explain)
                    rec["rank"] = rep.rank
                    rec["group_step"] = num_steps - 1
                    if added is not None:
                        rec["added"] = [rid for rid, rk in added if rk == rep.rank]
                    if deferred[rep.rank]:
                        rec["num_waiting"] += len(deferred[rep.rank])
                        rec["held_back"] = len(deferred[rep.rank])
                    rec["sim_time_s"] = round(end - transport.last_duration, 9)
                    rec["sim_duration_s"] = round(transport.last_duration, 9)
                    trace_out.write(json.dumps(rec, separators=(",", ":")) + "\n")
            if busy:
                num_busy += 1
            if group_running > max_running:
                max_running = group_running
            if series is not None and reports:
                _record(series, transport, reports, sum(len(q) for q in deferred))
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
    duration = max([transport.now, *(ex.now for ex in transport.executors)])
    summary = metrics.summary(duration, goodput_slos_ms, percentiles, detailed=detailed)
    stats = [r.scheduler.prefix_cache_stats for r in ranks]
    queries = sum(h.queries + h.preempted_queries for h in stats)
    hits = sum(h.hits + h.preempted_hits for h in stats)
    return SimResult(
        metrics=metrics,
        summary=summary,
        num_requests=n,
        num_steps=num_steps,
        num_busy_steps=num_busy,
        num_preemptions=sum(r.scheduler.num_preemptions for r in ranks),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
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
        data_parallel=_dp_figures(dp, transport),
    )


def _record(series: StepSeries, transport: SimTransport, reports: list, held: int) -> None:
    """One point of the group's state (sums over the ranks that reported)."""
    dur = transport.last_duration
    end = max(rep.time for rep in reports)
    prefill = decode = 0
    for rep in reports:
        if rep.executed:
            b = transport.executors[rep.rank].last_batch
            prefill += b.prefill_tokens
            decode += b.num_decodes
    series.time.append(end - dur)
    series.duration.append(dur)
    series.num_running.append(sum(rep.num_running for rep in reports))
    series.num_waiting.append(sum(rep.num_waiting for rep in reports) + held)
    series.kv_usage.append(sum(r.scheduler.kv_usage for r in transport.ranks) / transport.num_ranks)
    series.prefill_tokens.append(prefill)
    series.decode_tokens.append(decode)


def _dp_dict(dp: DPConfig) -> dict:
    return {
        "data_parallel_size": dp.data_parallel_size,
        "mode": "lockstep" if dp.lockstep else "independent",
        "balance_scheduling": dp.balance_scheduling,
        "prefill_schedule_interval": dp.prefill_schedule_interval,
        "sync_interval": dp.sync_interval,
    }


def _dp_figures(dp: DPConfig, transport: SimTransport) -> dict:
    """The DP run's own figures: what each rank did and how often the policies held back."""
    ranks = transport.ranks
    per_rank = [
        {
            "rank": r.rank,
            "requests": r.num_received,
            "steps": r.num_steps,
            "dummy_steps": r.num_dummy_steps,
            "gate_held_steps": r.gate.num_held if r.gate is not None else 0,
            "throttled_steps": r.num_throttled_steps,
            "preemptions": r.scheduler.num_preemptions,
        }
        for r in ranks
    ]
    gated = sum(p["gate_held_steps"] for p in per_rank)
    dummy = sum(p["dummy_steps"] for p in per_rank)
    figures = _dp_dict(dp)
    figures["per_rank"] = per_rank
    mode = "lock-step" if dp.lockstep else "independent"
    policies = []
    if dp.balance_scheduling:
        policies.append("balance")
    if dp.prefill_schedule_interval > 1:
        policies.append(f"prefill every {dp.prefill_schedule_interval}")
    figures["rows"] = [
        (
            "Data-parallel ranks:",
            f"{dp.data_parallel_size} ({mode}{', ' + ', '.join(policies) if policies else ''})",
        ),
        ("Requests per rank:", "/".join(str(p["requests"]) for p in per_rank)),
        ("Rank steps with nothing to run:", dummy),
        ("Rank steps held by the balance gate:", gated),
    ]
    if dp.prefill_schedule_interval > 1:
        figures["rows"].append(
            ("Rank steps with prefills throttled:", sum(p["throttled_steps"] for p in per_rank))
        )
    modes = transport.steps_by_launch_mode
    if dp.lockstep and any(modes):
        figures["launch_modes"] = dict(zip(LAUNCH_MODE_NAMES, modes))
        figures["rows"].append(
            (
                "Group steps graph/piecewise/eager:",
                f"{modes[LAUNCH_GRAPH]}/{modes[LAUNCH_PIECEWISE]}/{modes[LAUNCH_EAGER]}",
            )
        )
    return figures
