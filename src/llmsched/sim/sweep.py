"""Sweeps: many deployments simulated on one workload, to find the cheapest that meets an SLO.

A sweep file (YAML or JSON) names the knobs to vary and the workload:

    search: grid                 # or: random (with samples: N and seed: S)
    slo: {p99_ttft_ms: 2000}     # the latency a configuration must meet
    gpu_cost: {h100: 1.0}        # price per GPU by hardware (default 1 each)
    workload: {num_prompts: 500, input_len: 1024, output_len: 128, request_rate: 8}
    deployment: {model: llama-3-8b}          # fixed DeploymentSpec fields
    grid:                                    # DeploymentSpec fields and their values
      hardware: [h100, a100]
      tensor_parallel_size: [1, 2]
      data_parallel_size: [1, 2]
      max_num_seqs: [64, 128, 256]
      max_num_batched_tokens: [2048, 8192]
      scheduling_policy: [fcfs, priority]
      api_server_count: [1, 2]               # also balance_scheduling and
                                             # prefill_schedule_interval (simulate's
                                             # flags; DP policies need DP > 1)

Every point is an independent simulation, run on a local process pool or,
given a Ray address, as Ray tasks; each point's figures depend only on the
point, so both give the same table. The result: every point's throughput
per GPU, p99 TTFT and cost, the Pareto front of throughput per GPU against
p99 TTFT, and the cheapest configuration meeting the SLO.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from llmsched.core.errors import ConfigError
from llmsched.sim.deployment import Deployment, DeploymentSpec

if TYPE_CHECKING:
    from llmsched.engine.dp.config import DPConfig

_SPEC_FIELDS = {f.name for f in fields(DeploymentSpec)}
# How a deployment is run rather than built: the data-parallel policies and
# the API servers in front of each engine core (``llmsched simulate``'s flags).
_RUN_KEYS = {"balance_scheduling", "prefill_schedule_interval", "api_server_count"}
_WORKLOAD_KEYS = {
    "num_prompts",
    "input_len",
    "output_len",
    "range_ratio",
    "prefix_len",
    "num_prefix_groups",
    "num_priority_levels",
    "request_rate",
    "burstiness",
    "seed",
    "max_concurrency",
}
_WORKLOAD_DEFAULTS = {"num_prompts": 1000, "input_len": 1024, "output_len": 128, "request_rate": math.inf}
_TOP_KEYS = {"search", "samples", "seed", "slo", "gpu_cost", "workload", "deployment", "grid"}
_SLO_KEYS = {"p99_ttft_ms"}


@dataclass(slots=True)
class Sweep:
    """A parsed sweep: the points to simulate and how to judge them."""

    points: list[dict]
    workload: dict
    slo_p99_ttft_ms: float
    gpu_cost: dict[str, float] = field(default_factory=dict)


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file (YAML or JSON); ConfigError names what is wrong."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"sweep file {str(p)!r} does not exist")
    text = p.read_text()
    if p.suffix == ".json":
        data = json.loads(text)
    else:
        try:
            import yaml
        except ImportError as e:
            raise ConfigError(
                "a YAML sweep file needs PyYAML (pip install pyyaml), or write it as JSON"
            ) from e
        data = yaml.safe_load(text)
    return parse_sweep(data, str(p))


def parse_sweep(data: object, where: str = "sweep") -> Sweep:
    """Check a sweep's settings and expand its points."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top")
    _known(data, _TOP_KEYS, where)
    grid = data.get("grid") or {}
    fixed = data.get("deployment") or {}
    workload = {**_WORKLOAD_DEFAULTS, **(data.get("workload") or {})}
    slo = data.get("slo") or {}
    for name, section, keys in (
        ("grid", grid, _SPEC_FIELDS | _RUN_KEYS),
        ("deployment", fixed, _SPEC_FIELDS | _RUN_KEYS),
        ("workload", workload, _WORKLOAD_KEYS),
        ("slo", slo, _SLO_KEYS),
    ):
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: {name} must be a mapping")
        _known(section, keys, f"{where}: {name}")
    for knob, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: grid.{knob} must be a non-empty list of values")
    if "p99_ttft_ms" not in slo:
        raise ConfigError(f"{where}: slo.p99_ttft_ms is required (the p99 TTFT a configuration must meet)")
    search = data.get("search", "grid")
    knobs = list(grid)
    combos = list(itertools.product(*(grid[k] for k in knobs)))
    if search == "random":
        samples = data.get("samples")
        if not isinstance(samples, int) or samples < 1:
            raise ConfigError(f"{where}: random search needs samples: N (a positive integer)")
        rng = random.Random(data.get("seed", 0))
        combos = rng.sample(combos, samples) if samples < len(combos) else combos
    elif search != "grid":
        raise ConfigError(f"{where}: search {search!r} is unknown; use grid or random")
    points = [{**fixed, **dict(zip(knobs, combo))} for combo in combos]
    cost = data.get("gpu_cost") or {}
    return Sweep(points, workload, float(slo["p99_ttft_ms"]), {str(k): float(v) for k, v in cost.items()})


def _known(section: dict, keys: set[str], where: str) -> None:
    unknown = sorted(set(section) - keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(keys))}")


def run_point(point: dict, workload: dict) -> dict:
    """Simulate one configuration; its figures, or the reason it cannot run."""
    from llmsched.sim.deployment import build_deployment
    from llmsched.sim.frontend import Frontend
    from llmsched.sim.runner import simulate
    from llmsched.sim.workload import synthetic_workload

    t0 = time.perf_counter()
    row: dict = {"config": point}
    try:
        dep = build_deployment(DeploymentSpec(**{k: v for k, v in point.items() if k not in _RUN_KEYS}))
        w = dict(workload)
        max_concurrency = w.pop("max_concurrency", None)
        wl = synthetic_workload(w.pop("num_prompts"), w.pop("input_len"), w.pop("output_len"), **w)
        count = point.get("api_server_count")
        frontend = Frontend(count) if count is not None else None
        res = simulate(dep, wl, dp=_dp_config(dep, point), max_concurrency=max_concurrency, frontend=frontend)
    except (ConfigError, ValueError) as e:
        row["error"] = str(e)
        row["wall_s"] = time.perf_counter() - t0
        return row
    s = res.summary
    gpus = dep.cost_model.tp * dep.data_parallel_size
    row.update(
        gpus=gpus,
        hardware=dep.hardware.name,
        completed=s["completed"],
        output_throughput=s["output_throughput"],
        throughput_per_gpu=s["output_throughput"] / gpus,
        p99_ttft_ms=s["p99_ttft_ms"],
        mean_tpot_ms=s["mean_tpot_ms"],
        wall_s=time.perf_counter() - t0,
    )
    return row


def _dp_config(dep: Deployment, point: dict) -> DPConfig | None:
    """The point's data-parallel settings (None for one engine, where its DP policies cannot apply)."""
    from llmsched.engine.dp.config import DPConfig, lockstep_for

    balance = point.get("balance_scheduling", False)
    interval = point.get("prefill_schedule_interval", 1)
    if not isinstance(balance, bool):
        raise ConfigError(f"balance_scheduling={balance!r} must be true or false")
    if dep.data_parallel_size == 1:
        if balance or interval != 1:
            raise ConfigError("balance_scheduling and prefill_schedule_interval need data_parallel_size > 1")
        return None
    return DPConfig(
        dep.data_parallel_size,
        lockstep=lockstep_for(dep.model.is_moe),
        balance_scheduling=balance,
        prefill_schedule_interval=interval,
    )


def _run_point_args(args: tuple[dict, dict]) -> dict:
    return run_point(*args)


def run_sweep(
    sweep: Sweep,
    workers: int | None = None,
    ray_address: str | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[dict]:
    """Simulate every point (process pool, or Ray tasks with ``ray_address``); rows in point order."""
    jobs = [(p, sweep.workload) for p in sweep.points]
    if ray_address is not None:
        rows = _run_on_ray(jobs, ray_address)
    elif workers == 1:
        rows = [_run_point_args(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers or os.cpu_count()) as pool:
            rows = list(pool.map(_run_point_args, jobs, chunksize=max(1, len(jobs) // (8 * (workers or 4)))))
    for i, row in enumerate(rows):
        row["point"] = i
        row["cost"] = judge(row, sweep)
        if on_done is not None:
            on_done(i)
    return rows


def _run_on_ray(jobs: list[tuple[dict, dict]], address: str) -> list[dict]:
    """The points as Ray tasks on the cluster at ``address`` ("local": one started here)."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError("--ray-address needs Ray (pip install 'llmsched[sweep]')") from e
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address == "local" else address, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(_run_point_args)
        return ray.get([task.remote(j) for j in jobs])
    finally:
        if started:
            ray.shutdown()


def judge(row: dict, sweep: Sweep) -> float | None:
    """A point's price (GPUs x per-GPU cost); marks whether it meets the SLO. None if it did not run."""
    if "error" in row:
        row["meets_slo"] = False
        return None
    row["meets_slo"] = row["completed"] > 0 and row["p99_ttft_ms"] <= sweep.slo_p99_ttft_ms
    hw = row["config"].get("hardware", "h100")
    return row["gpus"] * sweep.gpu_cost.get(hw, 1.0)


def pareto_front(rows: Iterable[dict]) -> list[dict]:
    """Points no other beats on both throughput per GPU (higher) and p99 TTFT (lower), by p99 TTFT."""
    ok = sorted(
        (r for r in rows if "error" not in r and r["completed"]),
        key=lambda r: (r["p99_ttft_ms"], -r["throughput_per_gpu"], r["point"]),
    )
    front: list[dict] = []
    best = -math.inf
    for r in ok:
        if r["throughput_per_gpu"] > best:
            front.append(r)
            best = r["throughput_per_gpu"]
    return front


def cheapest(rows: Iterable[dict]) -> dict | None:
    """The cheapest point meeting the SLO (ties: more throughput per GPU, then lower p99 TTFT)."""
    meeting = [r for r in rows if r.get("meets_slo")]
    if not meeting:
        return None
    return min(meeting, key=lambda r: (r["cost"], -r["throughput_per_gpu"], r["p99_ttft_ms"], r["point"]))
