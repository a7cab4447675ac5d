#!/usr/bin/env python3
"""Async scheduling in the simulator: the same workload with async on and off, in one run.

vLLM 0.33 schedules step N+1 while step N runs on the GPU, so a step's host
path (scheduling, input preparation, kernel launches, output processing)
overlaps the other step's model time: a step costs about max(host, model)
instead of host + model. How much that buys depends on how the two
compare. Two deployments on one H100, each with the same workload
(1000 requests of 1024 prompt / 128 output tokens, all sent at once):

- ``llama-3-8b``: decode forwards of several milliseconds against a 0.5 ms
  host path;
- ``qwen3-0.6b``: forwards about as short as the host path, where the
  overlap matters most.

For each mode: output throughput, mean and median TPOT, and the host gap,
the time the device waits between the end of one forward and the start of
the next for the host path (sync: all of it; async: what the previous
forward did not hide, host - model when the host path is longer), median
and p99 over the steps; then the ratios async / sync. ``--speed`` also
times the simulator itself on ``sim_speed.py``'s workload in both modes.

The torch-executor half of the async benchmark lives elsewhere; this file's
functions (``run_sim_comparison``, ``sim_speed_comparison``) are importable.

    python benchmarks/features/async_overlap_sim.py [--models llama-3-8b,qwen3-0.6b] [--speed] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.sim import (  # noqa: E402
    DeploymentSpec,
    SimResult,
    build_deployment,
    simulate,
    synthetic_workload,
)

DEFAULT_MODELS = ("llama-3-8b", "qwen3-0.6b")
MODES = (("sync", False), ("async", True))
# Figures whose async / sync ratio is reported.
RATIO_KEYS = (
    "output_throughput",
    "mean_tpot_ms",
    "median_tpot_ms",
    "median_host_gap_ms",
    "p99_host_gap_ms",
)


def sim_figures(res: SimResult) -> dict:
    """The comparison's figures from one simulation."""
    s = res.summary
    costs = res.step_costs
    assert costs is not None, "a single-engine simulation reports its step costs"
    c = costs.to_dict(res.sim_duration_s)
    return {
        "output_throughput": s["output_throughput"],
        "request_throughput": s["request_throughput"],
        "mean_tpot_ms": s["mean_tpot_ms"],
        "median_tpot_ms": s["median_tpot_ms"],
        "mean_ttft_ms": s["mean_ttft_ms"],
        "median_host_gap_ms": c["median_host_gap_ms"],
        "p99_host_gap_ms": c["p99_host_gap_ms"],
        "mean_host_ms": c["mean_host_ms"],
        "mean_model_ms": c["mean_model_ms"],
        "model_busy_fraction": c["model_busy_fraction"],
        "completed": s["completed"],
        "num_steps": res.num_steps,
        "num_busy_steps": res.num_busy_steps,
        "sim_duration_s": res.sim_duration_s,
        "wall_s": res.wall_s,
    }


def ratios(sync: dict, asyn: dict) -> dict:
    """async / sync for each of RATIO_KEYS (None where sync is 0)."""
    return {k: (asyn[k] / sync[k] if sync[k] else None) for k in RATIO_KEYS}


def run_sim_comparison(
    model: str = "llama-3-8b",
    hardware: str = "h100",
    num_prompts: int = 1000,
    input_len: int = 1024,
    output_len: int = 128,
    request_rate: float = math.inf,
    seed: int = 0,
    **spec: object,
) -> dict:
    """Simulate one workload on one deployment with async scheduling off, then on; figures and ratios.

    ``spec`` holds further DeploymentSpec fields (max_num_seqs, ...); vLLM's
    defaults otherwise, as `llmsched simulate` uses them.
    """
    base = DeploymentSpec(model=model, hardware=hardware, **spec)  # type: ignore[arg-type]
    out: dict = {
        "model": model,
        "hardware": hardware,
        "workload": {
            "num_prompts": num_prompts,
            "input_len": input_len,
            "output_len": output_len,
            "request_rate": request_rate if not math.isinf(request_rate) else "inf",
            "seed": seed,
        },
    }
    for name, on in MODES:
        dep = build_deployment(replace(base, async_scheduling=on))
        wl = synthetic_workload(num_prompts, input_len, output_len, request_rate=request_rate, seed=seed)
        out[name] = sim_figures(simulate(dep, wl))
        out.setdefault("deployment", dep.describe())
    out["ratios"] = ratios(out["sync"], out["async"])
    return out


def sim_speed_comparison(num_requests: int = 10_000, request_rate: float = 30.0, repeats: int = 3) -> dict:
    """Wall time of the simulator itself in each mode on sim_speed.py's workload (best of ``repeats``)."""
    spec = DeploymentSpec(model="llama-3-8b", hardware="h100", max_num_seqs=128)
    out: dict = {
        "num_requests": num_requests,
        "request_rate": request_rate,
        "input_len": 1024,
        "output_len": 64,
    }
    for name, on in MODES:
        dep = build_deployment(replace(spec, async_scheduling=on))
        best = math.inf
        steps = 0
        for _ in range(repeats):
            wl = synthetic_workload(num_requests, 1024, 64, request_rate=request_rate, seed=0)
            t = time.perf_counter()
            res = simulate(dep, wl)
            best = min(best, time.perf_counter() - t)
            steps = res.num_steps
        out[name] = {
            "wall_s": best,
            "wall_us_per_request": best * 1e6 / num_requests,
            "num_steps": steps,
            "wall_us_per_step": best * 1e6 / max(steps, 1),
        }
    out["wall_ratio"] = out["async"]["wall_s"] / out["sync"]["wall_s"]
    return out


def format_comparison(cmp: dict) -> str:
    """A table: one row per figure, sync, async and their ratio."""
    rows = [
        ("Output throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("Mean TPOT (ms)", "mean_tpot_ms", "{:.3f}"),
        ("Median TPOT (ms)", "median_tpot_ms", "{:.3f}"),
        ("Host gap median (ms)", "median_host_gap_ms", "{:.3f}"),
        ("Host gap p99 (ms)", "p99_host_gap_ms", "{:.3f}"),
        ("Mean host path per step (ms)", "mean_host_ms", "{:.3f}"),
        ("Mean model time per step (ms)", "mean_model_ms", "{:.3f}"),
        ("Mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"),
        ("Device busy (share of the run)", "model_busy_fraction", "{:.3f}"),
        ("Engine steps", "num_steps", "{:d}"),
    ]
    w = cmp["workload"]
    lines = [
        f"{cmp['model']} on {cmp['hardware']}: {w['num_prompts']} requests of {w['input_len']}/"
        f"{w['output_len']} tokens, rate {w['request_rate']}",
        f"  {'':<32} {'sync':>12} {'async':>12} {'async/sync':>11}",
    ]
    for label, key, fmt in rows:
        a, b = cmp["sync"][key], cmp["async"][key]
        ratio = cmp["ratios"].get(key)
        if ratio is None and key not in RATIO_KEYS and a:
            ratio = b / a
        r = f"{ratio:.3f}" if ratio is not None else "-"
        lines.append(f"  {label:<32} {fmt.format(a):>12} {fmt.format(b):>12} {r:>11}")
    return "\n".join(lines)


def main() -> int:
    """Run the comparisons, print them, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated model profiles")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's for the hardware")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speed", action="store_true", help="also time the simulator in both modes")
    ap.add_argument("--json", default=str(ROOT / "results" / "async_overlap_sim.json"))
    args = ap.parse_args()
    spec = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    result: dict = {"simulator": []}
    for model in (m.strip() for m in args.models.split(",") if m.strip()):
        cmp = run_sim_comparison(
            model,
            args.hardware,
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.request_rate,
            args.seed,
            **spec,
        )
        result["simulator"].append(cmp)
        print(format_comparison(cmp))
        print()
    if args.speed:
        speed = sim_speed_comparison()
        result["sim_speed"] = speed
        sync, asyn = speed["sync"], speed["async"]
        print(
            f"simulator speed ({speed['num_requests']} requests, llama-3-8b, Poisson "
            f"{speed['request_rate']:g}/s, 1024/64): "
            f"sync {sync['wall_s']:.2f} s ({sync['num_steps']} steps), "
            f"async {asyn['wall_s']:.2f} s ({asyn['num_steps']} steps), x{speed['wall_ratio']:.2f}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record_cpu(result), f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
