"""The simulated transport: every rank in this process, on the simulator's virtual clock.

Lock-step: all ranks run each step; the step lasts as long as the slowest
rank's, each rank priced with the expert layers seeing the whole group's
tokens (expert parallelism) and launching its kernels in the mode every
rank can use (one rank's prefill makes the whole step eager), plus the
per-step exchange. A rank with
nothing to run executes a one-token dummy batch. Independent: each rank
keeps its own clock and the rank furthest behind steps next.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from llmsched.core.config import SchedulerConfig
from llmsched.core.request import Request
from llmsched.engine.dp.config import DPConfig
from llmsched.engine.dp.policies import PrefillCadence
from llmsched.engine.dp.rank import DPRank
from llmsched.engine.dp.transport import RankReport, RankStatus
from llmsched.engine.engine_core import EngineCore, EngineStep
from llmsched.executor.sim.cost_model import BatchShape, ConstantCostModel, StepCostModel
from llmsched.executor.sim.executor import SimExecutor

# The per-step exchange is a small CPU all-gather over gloo between the
# ranks' engine processes: on the order of 100 us on one host.
DEFAULT_SYNC_S = 1e-4
# What a rank with nothing to run executes so the group's collectives match.
DUMMY_BATCH = BatchShape(num_tokens=1, num_decodes=1, decode_context=1)


def group_launch_mode(cost_model: StepCostModel, batches: Sequence[BatchShape]) -> int | None:
    """The launch mode all ranks run a lock-step in: the lowest any rank can use (None: no modes)."""
    mode_of = getattr(cost_model, "launch_mode", None)
    if mode_of is None:
        return None
    return min(mode_of(b) for b in batches)


def group_step_time(
    cost_model: StepCostModel, batches: Sequence[BatchShape], mode: int | None = None
) -> float:
    """Seconds of one lock-step: the slowest rank, with the expert layers seeing every rank's tokens."""
    group = getattr(cost_model, "step_time_in_group", None)
    if group is None:
        return max(cost_model.step_time(b) for b in batches)
    total = 0
    for b in batches:
        total += b.num_tokens
    if mode is None:
        mode = group_launch_mode(cost_model, batches)
    return max(group(b, total, mode) for b in batches)


class SimTransport:
    """N ranks in one process; ``step()`` advances the virtual clock."""

    def __init__(
        self,
        config: SchedulerConfig,
        cost_model: StepCostModel,
        dp: DPConfig,
        *,
        sync_s: float = DEFAULT_SYNC_S,
        start_time: float = 0.0,
    ) -> None:
        if config.prefill_schedule_interval != dp.rank_prefill_interval:
            raise ValueError(
                f"rank config prefill_schedule_interval={config.prefill_schedule_interval}, but this "
                f"data-parallel mode needs {dp.rank_prefill_interval} (see DPConfig.rank_prefill_interval)"
            )
        self.dp = dp
        self.num_ranks = dp.data_parallel_size
        self.cost_model = cost_model
        self.sync_s = sync_s
        self.lockstep = dp.lockstep
        self.now = start_time
        self.cadence = PrefillCadence(dp.prefill_schedule_interval if dp.lockstep else 1)
        # Lock-step ranks only build batches (a free cost model); the group is priced here.
        self.ranks = [
            DPRank(
                r,
                EngineCore(
                    config,
                    SimExecutor(ConstantCostModel(0.0) if dp.lockstep else cost_model, start_time=start_time),
                ),
                dp,
            )
            for r in range(self.num_ranks)
        ]
        self.executors: list[SimExecutor] = [r.executor for r in self.ranks]  # type: ignore[misc]
        self.num_steps = 0
        self.num_dummy_rank_steps = 0
        # Executed lock-steps per launch mode (eager, piecewise, graph), when the cost model has modes.
        self.steps_by_launch_mode = [0, 0, 0]
        self.last_duration = 0.0
        self._since_sync = 0

    # ---- requests ------------------------------------------------------------

    def add_request(self, rank: int, request: Request) -> None:
        """Queue on ``rank``; an idle independent rank's clock first catches up with now."""
        r = self.ranks[rank]
        if not self.lockstep and not r.has_requests():
            self.executors[rank].advance_to(self.now)
        r.add_request(request)

    def abort_requests(self, rank: int, request_ids: Sequence[str]) -> None:
        """Abort on ``rank``."""
        self.ranks[rank].abort(request_ids)

    def has_work(self) -> bool:
        """True while any rank has requests (or finishes to report)."""
        return any(r.has_requests() for r in self.ranks)

    # ---- the clock -----------------------------------------------------------

    def next_step_time(self) -> float:
        """When the next step would start (inf when no rank has work)."""
        if self.lockstep:
            return self.now if self.has_work() else math.inf
        busy = [ex.now for r, ex in zip(self.ranks, self.executors) if r.has_requests()]
        return min(busy) if busy else math.inf

    def advance_to(self, t: float) -> None:
        """Move the front end's clock to ``t`` (idle ranks wait there for arrivals)."""
        if t > self.now:
            self.now = t
        if self.lockstep:
            for ex in self.executors:
                ex.advance_to(self.now)

    # ---- stepping ------------------------------------------------------------

    def step(self, timeout: float | None = None) -> list[RankReport]:
        """One lock-step of every rank, or one step of the independent rank furthest behind."""
        return self._lockstep() if self.lockstep else self._independent()

    def _lockstep(self) -> list[RankReport]:
        throttle = self.cadence.throttle()
        steps = [r.step(throttle) for r in self.ranks]
        batches: list[BatchShape] = []
        executed_any = False
        for ex, r in zip(self.executors, self.ranks):
            if r.executed:
                batches.append(ex.last_batch)
                executed_any = True
            else:
                batches.append(DUMMY_BATCH)
                self.num_dummy_rank_steps += 1
        dt = 0.0
        if executed_any:
            mode = group_launch_mode(self.cost_model, batches)
            if mode is not None:
                self.steps_by_launch_mode[mode] += 1
            dt = group_step_time(self.cost_model, batches, mode)
        self._since_sync += 1
        sync = self._since_sync >= self.dp.sync_interval or not executed_any
        if sync:
            dt += self.sync_s
            self._since_sync = 0
        self.now += dt
        self.last_duration = dt
        for ex in self.executors:
            ex.now = self.now
        statuses = [r.status() for r in self.ranks]
        group_running = any(s.unfinished for s in statuses) if sync else True
        for r in self.ranks:
            r.observe(statuses)
        self.cadence.advance(group_running)
        self.num_steps += 1
        return [self._report(r, es, st) for r, es, st in zip(self.ranks, steps, statuses)]

    def _independent(self) -> list[RankReport]:
        best = None
        for r, ex in zip(self.ranks, self.executors):
            if r.has_requests() and (best is None or ex.now < self.executors[best.rank].now):
                best = r
        if best is None:
            return []
        ex = self.executors[best.rank]
        es = best.step(False)
        self.last_duration = ex.last_duration if best.executed else 0.0
        self.num_steps += 1
        return [self._report(best, es, best.status())]

    def _report(self, rank: DPRank, es: EngineStep | None, status: RankStatus) -> RankReport:
        return RankReport(
            rank=rank.rank,
            outputs=rank.token_outputs(es),
            num_running=status.running,
            num_waiting=status.waiting,
            num_received=rank.num_received,
            num_preemptions=rank.scheduler.num_preemptions,
            time=self.executors[rank.rank].now,
            executed=rank.executed,
            engine_step=es,
        )

    def close(self) -> None:
        """Nothing to release beyond the executors."""
        for r in self.ranks:
            r.close()
