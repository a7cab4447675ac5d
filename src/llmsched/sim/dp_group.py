"""Data-parallel ranks in the simulation loop: N engines behind one router, one virtual clock.

Arrivals go through the DP front end (least-loaded routing) to the ranks
of a SimTransport; each step is one lock-step of every rank (or, for
independent ranks, one step of the rank furthest behind). Under FCFS a
request is routed when it arrives but built only once its rank's queue is
short enough for the scheduler to reach it (as one engine holds requests
back), so memory stays bounded.

With API servers modelled, each routes its own requests as vLLM's do, from
the coordinator's snapshots of the ranks (``ApiServerRouter``), published
every ``SNAPSHOT_INTERVAL_S`` of simulated time at the end of a step;
without them the router sees every rank's counts after every step.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import replace

from llmsched.bench.replay import step_record
from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import RequestRejected
from llmsched.engine.dp.config import DPConfig
from llmsched.engine.dp.engine import DPEngine
from llmsched.engine.dp.router import SNAPSHOT_INTERVAL_S, ApiServerRouter
from llmsched.engine.dp.sim_transport import SimTransport
from llmsched.executor.sim.cost_model import (
    LAUNCH_EAGER,
    LAUNCH_GRAPH,
    LAUNCH_MODE_NAMES,
    LAUNCH_PIECEWISE,
    StepCostModel,
)
from llmsched.sim.loop import Arrivals, Tally
from llmsched.sim.requests import SimRequest
from llmsched.sim.results import StepSeries


class DPGroup:
    """Implements the loop's Engines for ``dp.data_parallel_size`` simulated ranks."""

    def __init__(
        self,
        sched_config: SchedulerConfig,
        cost_model: StepCostModel,
        dp: DPConfig,
        sync_s: float,
        arrivals: Arrivals,
        tally: Tally,
        hold: bool,
    ) -> None:
        sched_config = replace(sched_config, prefill_schedule_interval=dp.rank_prefill_interval)
        self.dp = dp
        self.transport = SimTransport(sched_config, cost_model, dp, sync_s=sync_s)
        self.engine = DPEngine(self.transport, keep_results=False)
        self.ranks = self.transport.ranks
        for r in self.ranks:
            if tally.explain:
                r.scheduler.enable_trace()
            # Policies that read the time (slo) read the virtual clock arrivals use.
            r.scheduler.clock = self.clock
        self.arrivals = arrivals
        self.tally = tally
        self.hold = hold
        self.window = 2 * sched_config.max_num_seqs + 2
        self.max_num_seqs = sched_config.max_num_seqs
        # Requests routed to a rank at its cap while another had room (what stale routing costs).
        self.num_sent_to_full = 0
        self.live: dict[str, SimRequest] = {}
        # Routed but not yet built, per rank: (workload index, sent, order time).
        self.deferred: list[deque[tuple[int, float, float]]] = [deque() for _ in self.ranks]
        self.turns = 0
        # The API servers' routers (request i goes through server i mod count), and whose each request is.
        self.servers: list[ApiServerRouter] | None = None
        self.server_of: dict[str, ApiServerRouter] = {}
        self.next_snapshot = 0.0
        fe = arrivals.frontend
        if fe is not None:
            n = len(self.ranks)
            self.servers = [ApiServerRouter(n, fe.count, k) for k in range(fe.count)]

    def clock(self) -> float:
        """When the next rank step starts (the group's clock when none is due)."""
        now = self.transport.next_step_time()
        return self.transport.now if now == float("inf") else now

    def accepts(self) -> bool:
        """Routing never waits: the hold-back is per rank (see ``feed``)."""
        return True

    def add(self, i: int, sent: float, order_t: float, added: list | None) -> None:
        """Route request ``i``; build it now unless its rank's queue is held back."""
        self.transport.advance_to(self.arrivals.reach_time(i, sent))
        if self.hold:
            self.deferred[self.route(i)].append((i, sent, order_t))
        else:
            self._admit(self.arrivals.build(i, sent, order_t), self.route(i), added)

    def route(self, i: int) -> int:
        """The rank request ``i`` goes to: its API server's choice, or the front end's."""
        if self.servers is None:
            rank = self.engine.route()
        else:
            server = self.servers[i % len(self.servers)]
            self.server_of[self.arrivals.workload.request_id(i)] = server
            rank = server.route()
        cap = self.max_num_seqs
        if self._occupancy(rank) >= cap and any(self._occupancy(k) < cap for k in range(len(self.ranks))):
            self.num_sent_to_full += 1
        return rank

    def _occupancy(self, rank: int) -> int:
        """Requests on ``rank``: running and waiting."""
        return len(self.ranks[rank].scheduler.running) + self._waiting(rank)

    def _waiting(self, rank: int) -> int:
        """Requests waiting on ``rank``, those routed there but not yet built included."""
        return self.ranks[rank].scheduler.num_waiting + len(self.deferred[rank])

    def feed(self, added: list | None) -> None:
        """Build held-back requests while their rank's waiting queue is within reach."""
        if not self.hold:
            return
        for rank, queue in enumerate(self.deferred):
            waiting = self.ranks[rank].scheduler.waiting
            while queue and len(waiting) < self.window:
                self._admit(self.arrivals.build(*queue.popleft()), rank, added)

    def _admit(self, req: SimRequest, rank: int, added: list | None) -> None:
        """Hand a request routed to ``rank`` to the front end; count a rejection."""
        try:
            rank = self.engine.add_request(req, rank)
        except RequestRejected as e:
            self.tally.rejected(req, e)
            server = self.server_of.pop(req.request_id, None)
            if server is not None:
                server.finished(rank)
        else:
            self.live[req.request_id] = req
            if added is not None:
                added.append([req.request_id, rank])

    def has_work(self) -> bool:
        """True while any rank has something to run."""
        return self.transport.has_work()

    def has_held(self) -> bool:
        """True while routed requests wait to be built."""
        return any(self.deferred)

    def idle_until(self, t: float) -> None:
        """Jump the group's clock to the next arrival."""
        self.transport.advance_to(t)

    def step(self, now: float, added: list | None) -> None:
        """One group step; count every rank's tokens and finishes, write each rank's trace line."""
        reports = self.engine.step()
        tally = self.tally
        self.turns += 1
        tally.num_steps += 1
        group_running = 0
        busy = False
        for rep in reports:
            group_running += rep.num_running
            busy = busy or rep.executed
            self._count(rep)
            if tally.trace_out is not None and rep.engine_step is not None:
                self._trace(rep, added)
        if busy:
            tally.num_busy += 1
        if group_running > tally.max_running:
            tally.max_running = group_running
        if tally.series is not None and reports:
            self._record(tally.series, reports, sum(len(q) for q in self.deferred))
        if self.servers is not None and reports:
            self._publish(max(rep.time for rep in reports))

    def _publish(self, t: float) -> None:
        """The coordinator's snapshot of every rank's queues, when the last is old enough."""
        if t < self.next_snapshot:
            return
        self.next_snapshot = t + SNAPSHOT_INTERVAL_S
        counts = [
            (self._waiting(k), len(r.scheduler.running), r.scheduler.kv_usage)
            for k, r in enumerate(self.ranks)
        ]
        for server in self.servers:
            server.snapshot(counts)

    def _count(self, rep: object) -> None:
        """One rank's tokens (they share a time, and mostly a gap: counted together) and finishes."""
        end = rep.time
        tally = self.tally
        live = self.live
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
                tally.finished(r, end)
                server = self.server_of.pop(out.request_id, None)
                if server is not None:
                    server.finished(rep.rank)
        if tokens:
            tally.metrics.add_tokens_at(end, tokens)
        add_itl = tally.metrics.add_itl
        for gap, count in gaps.items():
            add_itl(gap, count)

    def _trace(self, rep: object, added: list | None) -> None:
        es = rep.engine_step
        transport = self.transport
        rec = step_record(es.scheduler_output.step, es, self.tally.explain)
        rec["rank"] = rep.rank
        rec["group_step"] = self.tally.num_steps - 1
        if added is not None:
            rec["added"] = [rid for rid, rk in added if rk == rep.rank]
        held = len(self.deferred[rep.rank])
        if held:
            rec["num_waiting"] += held
            rec["held_back"] = held
        rec["sim_time_s"] = round(rep.time - transport.last_duration, 9)
        rec["sim_duration_s"] = round(transport.last_duration, 9)
        self.tally.trace_out.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def _record(self, series: StepSeries, reports: list, held: int) -> None:
        """One point of the group's state (sums over the ranks that reported)."""
        transport = self.transport
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

    def result_fields(self) -> dict:
        """SimResult's fields that come from the ranks."""
        transport = self.transport
        stats = [r.scheduler.prefix_cache_stats for r in self.ranks]
        queries = sum(h.queries + h.preempted_queries for h in stats)
        hits = sum(h.hits + h.preempted_hits for h in stats)
        return {
            "num_preemptions": sum(r.scheduler.num_preemptions for r in self.ranks),
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "sim_duration_s": max([transport.now, *(ex.now for ex in transport.executors)]),
            "data_parallel": dp_figures(self.dp, transport, self.num_sent_to_full),
        }


def dp_dict(dp: DPConfig) -> dict:
    """The DP settings, as the trace header and the result JSON give them."""
    return {
        "data_parallel_size": dp.data_parallel_size,
        "mode": "lockstep" if dp.lockstep else "independent",
        "balance_scheduling": dp.balance_scheduling,
        "prefill_schedule_interval": dp.prefill_schedule_interval,
        "sync_interval": dp.sync_interval,
    }


def dp_figures(dp: DPConfig, transport: SimTransport, sent_to_full: int) -> dict:
    """The DP run's own figures: what each rank did, how often the policies held back, misroutes."""
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
        for r in transport.ranks
    ]
    figures = dp_dict(dp)
    figures["per_rank"] = per_rank
    figures["sent_to_full_rank"] = sent_to_full
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
        ("Rank steps with nothing to run:", sum(p["dummy_steps"] for p in per_rank)),
        ("Rank steps held by the balance gate:", sum(p["gate_held_steps"] for p in per_rank)),
        ("Sent to a full rank, another had room:", sent_to_full),
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
