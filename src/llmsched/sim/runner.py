"""``simulate()``: a workload through one engine or a data-parallel group on the virtual clock.

One loop (``loop.run_loop``) drives both: a single engine is the
``OneEngine`` (sync or async scheduling), ``data_parallel_size`` ranks
behind a router the ``DPGroup``. See ``loop`` for what happens each
iteration.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import IO

import llmsched
from llmsched.bench.metrics import DEFAULT_PERCENTILES
from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import ConfigError
from llmsched.engine.dp.config import DPConfig
from llmsched.engine.dp.sim_transport import DEFAULT_SYNC_S
from llmsched.executor.sim.cost_model import StepCostModel
from llmsched.sim.deployment import Deployment
from llmsched.sim.dp_group import DPGroup, dp_dict
from llmsched.sim.frontend import Frontend
from llmsched.sim.loop import Arrivals, Tally, run_loop
from llmsched.sim.one_engine import OneEngine
from llmsched.sim.requests import SimRequest
from llmsched.sim.results import RequestLog, SimResult, StepCosts, StepSeries
from llmsched.sim.workload import Workload

__all__ = ["SimRequest", "SimResult", "StepCosts", "StepSeries", "resolve_run", "simulate", "write_header"]


def simulate(
    config: SchedulerConfig | Deployment,
    workload: Workload,
    cost_model: StepCostModel | None = None,
    *,
    dp: DPConfig | None = None,
    sync_s: float = DEFAULT_SYNC_S,
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
    frontend: Frontend | None = None,
    record_requests: bool = False,
    vision: object = None,
    spec_decode: object = None,
) -> SimResult:
    """Run ``workload`` through the engine (or ``dp``'s ranks) on a virtual clock and measure it.

    ``config`` is a resolved Deployment (its per-rank scheduler config and
    cost model are used) or a bare SchedulerConfig together with
    ``cost_model``. The config's ``async_scheduling`` picks the engine loop
    and how a step's host path and model time combine (see SimExecutor).
    With ``dp`` the ranks are simulated behind one router, ``sync_s`` being
    their per-step exchange. ``fast_forward`` applies a single engine's
    plain decode steps (see ``PlainDecodes.plain_decode_steps``) without
    building their batches: the same steps, trace and figures. ``frontend``
    puts API servers between the client and the engine (see ``Frontend``);
    without it every request reaches the engine when it is sent. ``vision``
    (an ``executor.sim.vision_cost.VisionCost``) prices the images a step
    encodes (a single engine only). ``spec_decode`` (an
    ``executor.sim.spec_decode.SimSpecDecode``; by default the deployment's)
    simulates speculative decoding (a single engine only; the scheduler
    config must reserve its K draft slots).
    """
    deployment, sched_config, cost_model = resolve_run(config, cost_model, max_concurrency, "simulate")
    if trace_out is not None:
        extra: dict = {"data_parallel": dp_dict(dp)} if dp is not None else {}
        if frontend is not None:
            extra["frontend"] = frontend.to_dict()
        write_header(trace_out, sched_config, len(workload), deployment, cost_model, **extra)
    if spec_decode is None and deployment is not None:
        spec_decode = deployment.spec_decode
    if spec_decode is not None and sched_config.num_speculative_tokens != spec_decode.k:  # type: ignore[attr-defined]
        raise ConfigError(
            f"the scheduler reserves {sched_config.num_speculative_tokens} draft tokens but the speculative "
            f"config proposes {spec_decode.k}"  # type: ignore[attr-defined]
        )
    arrivals = Arrivals(workload, max_concurrency, frontend)
    series = StepSeries() if record_series else None
    tally = Tally(arrivals, trace_out, explain, series, progress)
    if record_requests:
        tally.records = []
    if detailed:
        tally.log = RequestLog(workload)
    # Priority order needs the whole queue built; so does --explain, which lists it.
    hold = hold_back and max_concurrency is None and sched_config.policy == "fcfs" and not explain
    if dp is not None:
        if vision is not None or spec_decode is not None:
            what = "images are priced" if vision is not None else "speculative decoding is simulated"
            raise ConfigError(f"{what} for a single engine; drop --data-parallel-size")
        engines = DPGroup(sched_config, cost_model, dp, sync_s, arrivals, tally, hold)
    else:
        engines = OneEngine(sched_config, cost_model, arrivals, tally, hold, fast_forward, max_steps)
        engines.ex.vision = vision
        if spec_decode is not None:
            engines.use_spec_decode(spec_decode)
    wall = run_loop(engines, arrivals, tally, max_steps)
    fields = engines.result_fields()
    duration = fields.pop("sim_duration_s")
    if arrivals.api is not None:
        # The run ends when the clients have the last tokens, not when the engine made them.
        duration = max(duration, arrivals.api.last_seen)
    summary = tally.metrics.summary(duration, goodput_slos_ms, percentiles)
    if tally.log is not None:
        summary.update(tally.log.lists())
    return SimResult(
        metrics=tally.metrics,
        summary=summary,
        num_requests=len(workload),
        num_steps=tally.num_steps,
        num_busy_steps=tally.num_busy,
        max_running=tally.max_running,
        num_length_capped=tally.capped,
        sim_duration_s=duration,
        wall_s=wall,
        rejections=tally.rejections,
        series=series,
        deployment=deployment,
        workload_description=workload.describe(),
        max_concurrency=max_concurrency,
        request_rate=workload.request_rate,
        percentiles=percentiles,
        frontend=_frontend_fields(frontend, arrivals),
        num_declined=tally.declined,
        requests=tally.records,
        **fields,
    )


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


def _frontend_fields(frontend: Frontend | None, arrivals: Arrivals) -> dict | None:
    """The frontend's settings for the result, and how much work streaming servers were given."""
    if frontend is None:
        return None
    out = frontend.to_dict()
    if arrivals.api is not None:
        out["busy_s"] = arrivals.api.busy
    return out
