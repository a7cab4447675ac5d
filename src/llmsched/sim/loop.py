"""The simulation loop, for one engine or many data-parallel ranks: arrivals, steps, measurements.

Each iteration adds every request whose arrival time the clock has passed
(and, with ``max_concurrency``, for which a client slot is free), then lets
the engines take one step: the unmodified scheduler decides each batch and
the cost model prices it on the virtual clock. Idle engines jump to the next
arrival. Requests are created when they arrive and dropped when they finish;
under FCFS a waiting queue longer than the scheduler can reach in one step
is held back unbuilt, so memory stays bounded by the requests in flight even
when a million arrive at once.

What differs between one engine and a data-parallel group (routing, the
clock, how a step's output is read) lives in an ``Engines`` object
(``one_engine.OneEngine``, ``dp_group.DPGroup``); this module owns what is
common: the client side (arrivals, client slots, request construction) and
the measurements (tokens, gaps, finishes, rejections, progress).
"""

from __future__ import annotations

import gc
import math
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Protocol

from llmsched.bench.metrics import MetricsCollector
from llmsched.core.errors import RequestRejected
from llmsched.core.sampling_params import SamplingParams
from llmsched.sim.frontend import ApiServers, Frontend
from llmsched.sim.requests import SimRequest
from llmsched.sim.workload import Workload

if TYPE_CHECKING:
    from tqdm import tqdm

    from llmsched.sim.results import RequestLog, StepSeries

# The error a request declined by the scheduling policy shows in the per-request lists.
DECLINED = "declined by the scheduling policy"
# Progress-bar updates are batched: tqdm costs a few microseconds per call.
_PROGRESS_EVERY = 64
# Failed requests whose reason is kept for the report.
_MAX_REJECTIONS_KEPT = 20


class Arrivals:
    """The client: the workload's requests in arrival order, when each is sent, and its Request."""

    __slots__ = (
        "api",
        "arrivals",
        "due_at",
        "frontend",
        "last_arrival",
        "loras",
        "n",
        "nxt",
        "out_lens",
        "params",
        "prios",
        "reached",
        "server_free",
        "slots",
        "workload",
    )

    def __init__(
        self, workload: Workload, max_concurrency: int | None, frontend: Frontend | None = None
    ) -> None:
        self.workload = workload
        self.n = len(workload)
        self.arrivals = workload.arrivals
        # When each request reaches the engine: when it is sent, unless API
        # servers stand in between.
        self.frontend = frontend
        self.due_at = workload.arrivals
        # Closed loop through API servers: when each server is next free. A
        # request is sent only once a client slot frees, so when it reaches
        # the engine is known only then (``_closed_reach``), not up front.
        self.server_free: list[float] | None = None
        # Servers that stream the output too: one queue of both paths, filled as the run goes.
        self.api: ApiServers | None = None
        if frontend is not None and frontend.streams:
            self.api = ApiServers(frontend)
            self.due_at = self.api.reach
        elif frontend is not None:
            if max_concurrency is None:
                self.due_at = frontend.delivery_times(workload.arrivals, workload.input_lens)
            else:
                self.server_free = [0.0] * frontend.count
        # When the request taken last reached the engine.
        self.reached = 0.0
        self.out_lens = workload.output_lens
        self.prios = workload.priorities
        self.loras = workload.loras
        self.nxt = 0
        self.last_arrival = -math.inf
        # Closed loop: when each client slot frees up.
        self.slots: deque[float] | None = deque([0.0] * max_concurrency) if max_concurrency else None
        self.params: dict[int, SamplingParams] = {}

    def pending(self) -> bool:
        """True while requests are left to send."""
        return self.nxt < self.n

    def due(self, now: float) -> bool:
        """True if the next request reaches the engine by ``now`` and a client slot is free for it."""
        i = self.nxt
        if self.api is not None:
            self.commit_through(now)
            return i < self.api.committed and self.api.reach[i] <= now
        if self.server_free is not None:
            return i < self.n and self._closed_reach() <= now
        return i < self.n and self.due_at[i] <= now and (self.slots is None or bool(self.slots))

    def next_time(self) -> float:
        """When the next request reaches the engine (inf: none left)."""
        if self.nxt >= self.n:
            return math.inf
        api = self.api
        if api is not None:
            if self.nxt >= api.committed:
                # Nothing runs: no output can come before the next request's input.
                sent = self._next_sent(self.nxt)
                if sent == math.inf:
                    return math.inf
                self.commit_through(sent)
            return api.reach[self.nxt]
        return self._closed_reach() if self.server_free is not None else self.due_at[self.nxt]

    def next_due_time(self) -> float:
        """When the next request reaches the engine, or never while no client slot is free for it."""
        if self.nxt >= self.n or (self.slots is not None and not self.slots):
            return math.inf
        api = self.api
        if api is not None:
            i = self.nxt
            if i < api.committed:
                return api.reach[i]
            # Not yet sent: outputs queued before it can only make it later.
            return api.reach_bound(i, self._next_sent(i), self.workload.input_lens[i])
        return self._closed_reach() if self.server_free is not None else self.due_at[self.nxt]

    def _next_sent(self, i: int) -> float:
        """When request ``i`` (not yet taken) is sent: the next ones take the next client slots."""
        if self.slots is None:
            return self.arrivals[i]
        k = i - self.nxt
        if k >= len(self.slots):
            return math.inf
        return self._sent_at(i, self.slots[k])

    def commit_through(self, t: float) -> None:
        """Queue at the API servers every request sent by ``t`` (in order), before any later job."""
        api = self.api
        i = api.committed
        lens = self.workload.input_lens
        while i < self.n:
            sent = self._next_sent(i)
            if sent > t:
                return
            api.commit(sent, lens[i])
            i += 1

    def _closed_reach(self) -> float:
        """Closed loop through API servers: when the next request would reach the engine (inf: no slot)."""
        slots = self.slots
        if not slots:
            return math.inf
        i = self.nxt
        return self._passed_on(i, self._sent_at(i, slots[0]), self.server_free)

    def _sent_at(self, i: int, slot_free: float) -> float:
        """When request ``i`` is sent by a client whose slot frees at ``slot_free``."""
        t = self.arrivals[i]
        return t if t > slot_free else slot_free

    def _passed_on(self, i: int, sent: float, server_free: list[float]) -> float:
        """When request ``i``, sent at ``sent``, leaves its API server (``server_free``: when each frees)."""
        return self.frontend.done_at(sent, server_free[i % len(server_free)], self.workload.input_lens[i])

    def reach_time(self, i: int, sent: float) -> float:
        """When request ``i``, sent at ``sent`` and just taken, reaches the engine."""
        if self.frontend is None:
            return sent
        return self.reached if self.server_free is not None else self.due_at[i]

    def num_due(self, now: float) -> int:
        """Requests not yet taken that have reached the engine by ``now``."""
        if self.api is not None:
            reach = self.api.reach
            return sum(1 for i in range(self.nxt, self.api.committed) if reach[i] <= now)
        return bisect_right(self.due_at, now, self.nxt) - self.nxt if self.nxt < self.n else 0

    def in_frontend(self, now: float) -> int:
        """Requests sent by ``now`` that the API servers have not handed to the engine yet."""
        if self.frontend is None or self.nxt >= self.n:
            return 0
        if self.api is not None:
            return self._streamed_in_frontend(now)
        if self.server_free is not None:
            return self._closed_in_frontend(now)
        return bisect_right(self.arrivals, now, self.nxt) - bisect_right(self.due_at, now, self.nxt)

    def _closed_in_frontend(self, now: float) -> int:
        """``in_frontend`` in a closed loop: the next requests each take the next free slot, in order."""
        free = list(self.server_free)
        count = 0
        for k, slot in enumerate(self.slots):
            i = self.nxt + k
            if i >= self.n:
                break
            sent = self._sent_at(i, slot)
            if sent > now:
                break
            free[i % len(free)] = done = self._passed_on(i, sent, free)
            if done > now:
                count += 1
        return count

    def _streamed_in_frontend(self, now: float) -> int:
        """``in_frontend`` through streaming servers (reads, never queues: a trace changes nothing)."""
        api = self.api
        sent, reach = api.sent, api.reach
        count = sum(1 for i in range(self.nxt, api.committed) if sent[i] <= now < reach[i])
        i = api.committed
        while i < self.n and self._next_sent(i) <= now:
            count += 1
            i += 1
        return count

    def take(self) -> tuple[int, float, float]:
        """Send the next request (``due`` must hold): its index, sent time and ordering time."""
        i = self.nxt
        if self.api is not None:
            # Queued at its server already, with the slot it took then.
            sent = self.api.sent[i]
            if self.slots is not None:
                self.slots.popleft()
            self.reached = self.api.reach[i]
        else:
            sent = self.arrivals[i] if self.slots is None else self._sent_at(i, self.slots.popleft())
        servers = self.server_free
        if servers is not None:
            servers[i % len(servers)] = self.reached = self._passed_on(i, sent, servers)
        # The scheduler breaks priority ties by arrival time: keep it
        # strictly increasing in arrival order, as wall-clock arrivals are.
        last = self.last_arrival
        order_t = sent if sent > last else math.nextafter(last, math.inf)
        self.last_arrival = order_t
        self.nxt = i + 1
        return i, sent, order_t

    def build(self, i: int, sent: float, order_t: float) -> SimRequest:
        """Workload request ``i``, built now (its prompt included)."""
        out_len = self.out_lens[i]
        sp = self.params.get(out_len)
        if sp is None:
            sp = self.params[out_len] = SamplingParams(max_tokens=out_len, ignore_eos=True)
        wl = self.workload
        return SimRequest(
            wl.request_id(i),
            wl.prompt(i),
            sp,
            priority=self.prios[i] if self.prios is not None else 0,
            tenant=wl.tenants[i] if wl.tenants is not None else None,
            lora_id=self.loras[i] if self.loras is not None else 0,
            arrival_time=order_t,
            sent_time=sent,
            index=i,
            mm_items=wl.mm_items(i) if wl.images is not None else (),
        )


class Tally:
    """The measurements: metrics at the client, counters, rejections, and the progress bar."""

    __slots__ = (
        "arrivals",
        "bar",
        "capped",
        "declined",
        "done_pending",
        "explain",
        "log",
        "max_running",
        "metrics",
        "num_busy",
        "num_steps",
        "pending",
        "records",
        "rejections",
        "series",
        "trace_out",
    )

    def __init__(
        self,
        arrivals: Arrivals,
        trace_out: IO[str] | None,
        explain: bool,
        series: StepSeries | None,
        progress: bool,
    ) -> None:
        self.arrivals = arrivals
        self.metrics = MetricsCollector() if arrivals.api is None else _StreamedMetrics(self)
        # Finishes whose last tokens the API servers have not been handed yet: (request, engine time).
        self.pending: list[tuple[SimRequest, float]] = []
        self.trace_out = trace_out
        self.explain = explain
        self.series = series
        self.rejections: list[tuple[str, str]] = []
        self.bar = _progress_bar(arrivals.n, progress)
        self.done_pending = 0
        self.num_steps = self.num_busy = self.max_running = self.capped = self.declined = 0
        # Per-request (tenant, sent, first token, end, prompt, output) when asked for.
        self.records: list[tuple] | None = None
        # vLLM's per-request lists, in dataset order, when asked for (--save-detailed).
        self.log: RequestLog | None = None

    def rejected(self, req: SimRequest, err: RequestRejected) -> None:
        """Count a request the engine refused; its client slot frees at once."""
        self.metrics.add_failed(req.num_prompt_tokens)
        self.done_pending += 1
        if self.log is not None:
            self.log.failed(req.index, req.sent_time, req.num_prompt_tokens, str(err))
        if len(self.rejections) < _MAX_REJECTIONS_KEPT:
            self.rejections.append((req.request_id, str(err)))
        slots = self.arrivals.slots
        if slots is not None:
            slots.appendleft(req.sent_time)

    def finished(self, r: SimRequest, end: float) -> None:
        """Count a finished request's latencies and free its client slot."""
        api = self.arrivals.api
        if api is not None and end > api.horizon():
            # Its last tokens are not queued at the API servers yet (``streamed`` counts it then).
            self.pending.append((r, end))
            return
        self._count_finish(r, end)

    def _count_finish(self, r: SimRequest, end: float) -> None:
        """``finished``, with the times the client sees when API servers stream the output."""
        first = r.first_token_time
        api = self.arrivals.api
        if api is not None:
            end = api.seen(end)
            if first >= 0:
                first = api.seen(first)
        if self.records is not None:
            self.records.append((r.tenant, r.sent_time, first, end, r.num_prompt_tokens, r.num_output_tokens))
        if first < 0:
            # Declined by the scheduling policy before producing anything.
            self.declined += 1
            self.metrics.add_failed(r.num_prompt_tokens)
            if self.log is not None:
                self.log.failed(r.index, r.sent_time, r.num_prompt_tokens, DECLINED)
            self.done_pending += 1
            if self.arrivals.slots is not None:
                self.arrivals.slots.append(end)
            return
        self.metrics.add_request(r.sent_time, first, end, r.num_prompt_tokens, r.num_output_tokens)
        if self.log is not None:
            self.log.done(r.index, r.sent_time, first, end, r.num_prompt_tokens, r.num_output_tokens)
        slots = self.arrivals.slots
        if slots is not None:
            slots.append(end)
        if r.num_tokens - r.num_prompt_tokens < r.max_tokens:
            self.capped += 1  # cut short by max_model_len
        self.done_pending += 1

    def streamed(self, t: float, tokens: int) -> None:
        """A step ending at ``t`` gave ``tokens`` output tokens: queued behind the inputs sent by ``t``."""
        self.arrivals.commit_through(t)
        self.arrivals.api.output(t, tokens)
        if self.pending:
            self.flush(t)

    def flush(self, t: float) -> None:
        """Count the pending finishes from engine times up to ``t``."""
        done = [(r, end) for r, end in self.pending if end <= t]
        if done:
            self.pending = [(r, end) for r, end in self.pending if end > t]
            for r, end in done:
                self._count_finish(r, end)

    def progress(self) -> None:
        """Move the progress bar on now and then."""
        if self.bar is not None and self.done_pending and self.num_steps % _PROGRESS_EVERY == 0:
            self.bar.update(self.done_pending)
            self.done_pending = 0

    def close(self) -> None:
        """Count any finish still pending and finish the progress bar."""
        if self.pending:
            pending, self.pending = self.pending, []
            for r, end in pending:
                self._count_finish(r, end)
        if self.bar is not None:
            self.bar.update(self.done_pending)
            self.bar.close()


class Engines(Protocol):
    """One engine or a data-parallel group, as the loop drives it."""

    # Loop turns taken (what max_steps bounds).
    turns: int

    def clock(self) -> float:
        """The time up to which arrivals are added before the next step."""

    def accepts(self) -> bool:
        """False while the engines should not be handed more requests yet (the FCFS hold-back)."""

    def add(self, i: int, sent: float, order_t: float, added: list | None) -> None:
        """Hand workload request ``i`` to the engines (build it, route it, or hold it back)."""

    def feed(self, added: list | None) -> None:
        """Build held-back requests the engines can now reach."""

    def has_work(self) -> bool:
        """True while a step would do anything."""

    def has_held(self) -> bool:
        """True while routed requests wait to be built."""

    def idle_until(self, t: float) -> None:
        """Nothing to run: move the clock to the next arrival at ``t``."""

    def step(self, now: float, added: list | None) -> None:
        """Take one step (a lock-step of every rank, or one rank's step) and record what it produced."""


def run_loop(engines: Engines, arrivals: Arrivals, tally: Tally, max_steps: int | None) -> float:
    """Run the workload to the end (or ``max_steps`` turns); returns the wall seconds it took."""
    tracing = tally.trace_out is not None
    gc_was_enabled = gc.isenabled()
    # The loop allocates many short-lived objects and no cycles; the cyclic
    # collector would only rescan the live requests' token lists over and over
    # (it is restored below, whatever happens).
    gc.disable()
    t_wall = time.perf_counter()
    try:
        while True:
            now = engines.clock()
            if tally.pending:
                tally.flush(now)  # finishes no later output job has settled
            added: list | None = [] if tracing else None
            while arrivals.due(now) and engines.accepts():
                engines.add(*arrivals.take(), added)
            engines.feed(added)
            if not engines.has_work():
                if engines.has_held():
                    continue  # fed to their ranks on the next pass
                if not arrivals.pending():
                    break
                if arrivals.slots is not None and not arrivals.slots:
                    raise AssertionError("no client slot is free while no request runs")
                engines.idle_until(arrivals.next_time())
                continue
            if max_steps is not None and engines.turns >= max_steps:
                break
            engines.step(now, added)
            tally.progress()
    finally:
        wall = time.perf_counter() - t_wall
        if gc_was_enabled:
            gc.enable()
        tally.close()
    return wall


class _StreamedMetrics(MetricsCollector):
    """The metrics, also handing each step's output tokens to the streaming API servers."""

    __slots__ = ("tally",)

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def add_tokens_at(self, t: float, count: int) -> None:
        """``count`` output tokens at ``t``, streamed by the API servers."""
        super().add_tokens_at(t, count)
        self.tally.streamed(t, count)

    def add_step_tokens(self, ends: Sequence[float], count: int) -> None:
        """``count`` tokens at each of ``ends``, each step's streamed in turn.

        Every bulk adder (``add_steps``, the simulator's plain decode runs) comes through here.
        """
        super().add_step_tokens(ends, count)
        if count:
            streamed = self.tally.streamed
            for end in ends:
                streamed(end, count)


def _progress_bar(total: int, enabled: bool) -> tqdm | None:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: tqdm shows itself only on a terminal.
    return tqdm(total=total, unit="req", desc="simulating", disable=None, mininterval=0.5)
