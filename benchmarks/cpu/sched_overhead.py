#!/usr/bin/env python3
"""Scheduler cost per step: schedule() + update_from_output() at ~1000 running requests.

Workload: 2048 requests x 128-token prompts x 256 output tokens,
max_num_seqs 1024, max_num_batched_tokens 8192, prefix caching on, no model
(tokens fabricated as in replay). A run's figure is the median of
schedule() + update_from_output() over its steps with at least 1000 running
requests, in wall time and in the calling thread's CPU time (the steadier
figure on a shared machine); each side runs ``--repeats`` times and reports
the median of its runs' figures.

Scheduling mode: async by default (vLLM 0.33's default: the next step is
planned while the model runs the current one, and a step's output is
applied one loop turn later); ``--modes async,sync`` also measures the
synchronous mode beside it.

If vLLM's reference driver is available (``--vllm-python``, or the default
../vllm-ref-venv next to the checkout), the same workload runs through vLLM's
own scheduler (``AsyncScheduler`` in async mode) in the same invocation, as
many times as llmsched's, alternating with it, and the ratio of the two
medians is reported; the traces of each mode's first runs must also match
decision for decision. llmsched runs in this process, vLLM in a fresh child
process per run.

    python benchmarks/cpu/sched_overhead.py [--modes async,sync] [--repeats 5] [--json FILE]

``--policies sjf,fair,...`` also runs the workload (requests spread over
four tenants) under each scheduling policy in the first mode, interleaved
with FCFS runs, and reports each policy's median step cost (median of its
runs) as a ratio to FCFS's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))

from hostcpu import record_cpu  # noqa: E402

from llmsched.bench.parity import compare, load_trace  # noqa: E402
from llmsched.bench.replay import replay  # noqa: E402
from llmsched.bench.workload import parse_workload  # noqa: E402
from llmsched.core.scheduler import Scheduler  # noqa: E402

STEADY_MIN_RUNNING = 1000
MODES = ("async", "sync")
# vLLM 0.33 schedules asynchronously unless told otherwise: the headline mode.
DEFAULT_MODES = "async"


def make_workload(num_requests: int, prompt_len: int, output_len: int, mode: str = "async") -> dict:
    """The benchmark workload in replay format (prompts unique per request), in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"scheduling mode {mode!r} is not one of {', '.join(MODES)}")
    return {
        "config": {
            "max_num_batched_tokens": 8192,
            "max_num_seqs": 1024,
            "enable_prefix_caching": True,
            "async_scheduling": mode == "async",
        },
        "requests": [
            {"id": str(i), "arrival_step": 0, "prompt_len": prompt_len, "max_tokens": output_len}
            for i in range(num_requests)
        ],
    }


def steady_figures(steady: list[int], steady_cpu: list[int]) -> dict:
    """Median and p90 (ms) of one run's steady-step costs (ns): wall time, and thread CPU time."""
    if not steady:
        return {
            "steady_steps": 0,
            "median_ms": float("nan"),
            "p90_ms": float("nan"),
            "cpu_median_ms": float("nan"),
        }
    return {
        "steady_steps": len(steady),
        "median_ms": statistics.median(steady) / 1e6,
        "p90_ms": sorted(steady)[int(0.9 * (len(steady) - 1))] / 1e6,
        "cpu_median_ms": statistics.median(steady_cpu) / 1e6,
    }


@contextlib.contextmanager
def thread_cpu_per_step() -> Iterator[dict[int, int]]:
    """Thread CPU time (ns) of schedule() + update_from_output(), by step index, while active.

    The engine times both calls in wall time only; on a shared machine the
    CPU time the calls themselves took is the steadier figure, and vLLM's
    driver records it too.
    """
    cpu: dict[int, int] = {}
    orig_schedule, orig_update = Scheduler.schedule, Scheduler.update_from_output

    def schedule(self: Scheduler, *a: Any, **kw: Any) -> Any:
        c0 = time.thread_time_ns()
        so = orig_schedule(self, *a, **kw)
        cpu[so.step] = cpu.get(so.step, 0) + time.thread_time_ns() - c0
        return so

    def update_from_output(self: Scheduler, out: Any, *a: Any, **kw: Any) -> Any:
        c0 = time.thread_time_ns()
        res = orig_update(self, out, *a, **kw)
        cpu[out.step] = cpu.get(out.step, 0) + time.thread_time_ns() - c0
        return res

    Scheduler.schedule, Scheduler.update_from_output = schedule, update_from_output
    try:
        yield cpu
    finally:
        Scheduler.schedule, Scheduler.update_from_output = orig_schedule, orig_update


def run_llmsched(wl: dict, trace_path: str | None) -> dict:
    """Replay through llmsched; per-step costs of the steady steps."""
    workload = parse_workload(wl)
    steady: list[int] = []
    steady_cpu: list[int] = []

    with thread_cpu_per_step() as cpu:

        def on_step(_step: int, es) -> None:
            if es.num_running >= STEADY_MIN_RUNNING:
                steady.append(es.schedule_ns + es.update_ns)
                steady_cpu.append(cpu[es.scheduler_output.step])

        gc.collect()
        gc.freeze()
        out = open(trace_path, "w") if trace_path else None  # noqa: SIM115
        t0 = time.perf_counter()
        summary = replay(workload, out, on_step=on_step)
        wall = time.perf_counter() - t0
        if out is not None:
            out.close()
        gc.unfreeze()
    return {
        "steps": summary.num_steps,
        **steady_figures(steady, steady_cpu),
        "loop_wall_s": round(wall, 3),
        "finished": summary.num_finished,
    }


def run_vllm(python: str, driver: str, wl_path: str, trace_path: str, detail: bool) -> dict | None:
    """Run vLLM's reference driver on the same workload; its steady-step costs."""
    cmd = [python, driver, wl_path, trace_path, "--steady-min-running", str(STEADY_MIN_RUNNING)]
    if not detail:
        cmd.append("--no-detail")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"vLLM reference failed ({proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
        return None
    steady = [s for s in load_trace(trace_path) if s["num_running"] >= STEADY_MIN_RUNNING]
    return steady_figures(
        [s["schedule_ns"] + s["update_ns"] for s in steady],
        [s["schedule_cpu_ns"] + s["update_cpu_ns"] for s in steady],
    )


def summarize(runs: list[dict]) -> dict:
    """One side's figure: the median over its runs of each run's median (and p90)."""
    return {
        "runs": len(runs),
        "steady_steps": runs[0]["steady_steps"],
        "median_ms": statistics.median(r["median_ms"] for r in runs),
        "p90_ms": statistics.median(r["p90_ms"] for r in runs),
        "cpu_median_ms": statistics.median(r["cpu_median_ms"] for r in runs),
        "run_medians_ms": [round(r["median_ms"], 4) for r in runs],
        "run_cpu_medians_ms": [round(r["cpu_median_ms"], 4) for r in runs],
    }


def parse_modes(text: str) -> list[str]:
    """``--modes``: a comma-separated list of async and sync, first one the headline."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"--modes {text!r}: give async and/or sync, each once")
    return modes


def build_parser() -> argparse.ArgumentParser:
    """Command line; its defaults are the configuration the README's figures come from."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument(
        "--modes",
        type=parse_modes,
        default=parse_modes(DEFAULT_MODES),
        help="scheduling modes, comma-separated, the first one headlined (default: async, vLLM 0.33's)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per side and mode, alternating; the median of the runs' medians is reported",
    )
    default_py = ROOT.parent / "vllm-ref-venv" / "bin" / "python"
    default_driver = ROOT.parent / "shared" / "vllm_ref" / "drive_vllm.py"
    ap.add_argument("--vllm-python", default=str(default_py) if default_py.exists() else None)
    ap.add_argument("--vllm-driver", default=str(default_driver))
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline")
    ap.add_argument("--json", default=str(ROOT / "results" / "sched_overhead.json"))
    ap.add_argument("--policies", default="", help="comma-separated policies to compare with FCFS")
    return ap


def compare_policies(args: argparse.Namespace) -> int:
    """Median step cost per policy, interleaved with FCFS runs; ratios to FCFS."""
    mode = args.modes[0]
    policies = ["fcfs", *[p for p in args.policies.split(",") if p and p != "fcfs"]]
    medians: dict[str, list[float]] = {p: [] for p in policies}
    for k in range(args.repeats):
        for p in policies:
            wl = make_workload(args.num_requests, args.prompt_len, args.output_len, mode)
            wl["config"]["policy"] = p
            if p.split("+")[0] == "slo":
                # Replay's clock counts steps: a deadline no request misses keeps the
                # workload whole while every admission still pays for the check.
                wl["config"]["policy_config"] = {"ttft_slo_s": 1e9}
            for i, r in enumerate(wl["requests"]):
                r["tenant"] = f"t{i % 4}"
            medians[p].append(run_llmsched(wl, None)["median_ms"])
            print(f"run {k + 1} {mode} {p:<22} median {medians[p][-1]:.3f} ms", flush=True)
    base = statistics.median(medians["fcfs"])
    rows = {
        p: {
            "median_ms": round(statistics.median(m), 4),
            "ratio_to_fcfs": round(statistics.median(m) / base, 3),
            "run_medians_ms": [round(x, 4) for x in m],
        }
        for p, m in medians.items()
    }
    print()
    print(f"{mode} scheduling, median of {args.repeats} runs each")
    print(f"{'policy':<24} {'median ms':>10} {'x FCFS':>7}")
    for p, r in rows.items():
        print(f"{p:<24} {r['median_ms']:>10.3f} {r['ratio_to_fcfs']:>7.2f}")
    result = record_cpu(
        {"mode": mode, "repeats": args.repeats, "statistic": "median of runs", "policies": rows}
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return 0


def measure_mode(args: argparse.Namespace, mode: str, tmp: str, k: int, runs: dict) -> None:
    """Round ``k`` of ``mode``: one llmsched run and one vLLM run, which goes first alternating."""
    wl_path = os.path.join(tmp, f"workload_{mode}.json")
    if k == 0:
        with open(wl_path, "w") as f:
            json.dump(make_workload(args.num_requests, args.prompt_len, args.output_len, mode), f)
    with open(wl_path) as f:
        wl = json.load(f)
    # The first round of each side writes the full trace, compared afterwards.
    ours_trace = os.path.join(tmp, f"llmsched_{mode}.jsonl") if k == 0 else None
    vllm_trace = os.path.join(tmp, f"vllm_{mode}_{k}.jsonl")
    sides = ["llmsched", "vllm"] if runs["vllm_python"] else ["llmsched"]
    if k % 2:
        sides.reverse()
    for side in sides:
        if side == "llmsched":
            res = run_llmsched(wl, ours_trace)
        else:
            res = run_vllm(runs["vllm_python"], args.vllm_driver, wl_path, vllm_trace, detail=k == 0)
            if res is None:
                runs["vllm_python"] = None
                runs[mode].pop("vllm", None)
                continue
        runs[mode].setdefault(side, []).append(res)
        print(
            f"{mode:<5} run {k + 1} {side:<8}: median {res['median_ms']:.3f} ms "
            f"(CPU {res['cpu_median_ms']:.3f} ms) over {res['steady_steps']} steps",
            flush=True,
        )


def mode_result(args: argparse.Namespace, mode: str, tmp: str, runs: dict) -> dict:
    """One mode's figures: each side's median of run medians, the ratio, the decision check."""
    ours = summarize(runs[mode]["llmsched"])
    out: dict = {"llmsched": ours}
    if runs[mode].get("vllm"):
        vllm = summarize(runs[mode]["vllm"])
        diffs = compare(
            load_trace(os.path.join(tmp, f"llmsched_{mode}.jsonl")),
            load_trace(os.path.join(tmp, f"vllm_{mode}_0.jsonl")),
        )
        vllm["decisions_identical"] = not diffs
        out["vllm"] = vllm
        out["speedup_vs_vllm"] = round(vllm["median_ms"] / ours["median_ms"], 2)
        out["cpu_speedup_vs_vllm"] = round(vllm["cpu_median_ms"] / ours["cpu_median_ms"], 2)
    return out


def print_table(modes: list[str], results: dict, repeats: int) -> None:
    """The figures per mode and side."""
    print()
    print(f"median over {repeats} runs per side of each run's median steady-step cost")
    print(f"{'mode':<6} {'scheduler':<10} {'steady steps':>12} {'median ms':>10} {'p90 ms':>8} {'CPU ms':>8}")
    for mode in modes:
        r = results[mode]
        for side in ("llmsched", "vllm"):
            if side in r:
                s = r[side]
                print(
                    f"{mode:<6} {side:<10} {s['steady_steps']:>12} "
                    f"{s['median_ms']:>10.3f} {s['p90_ms']:>8.3f} {s['cpu_median_ms']:>8.3f}"
                )
        if "vllm" in r:
            print(
                f"{mode:<6} llmsched is {r['speedup_vs_vllm']}x cheaper per step in wall time, "
                f"{r['cpu_speedup_vs_vllm']}x in CPU time "
                f"(decisions identical: {r['vllm']['decisions_identical']})"
            )
    if "vllm" not in results[modes[0]]:
        print("vLLM baseline not run (no reference environment); target is 2.5 ms")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the figures, write JSON."""
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: at least one run per side")
    if args.policies:
        return compare_policies(args)
    result = record_cpu({})
    vllm_python = None
    if not args.no_vllm and args.vllm_python and Path(args.vllm_driver).exists():
        vllm_python = args.vllm_python
    runs: dict = {"vllm_python": vllm_python, **{m: {} for m in args.modes}}
    with tempfile.TemporaryDirectory(prefix="sched_overhead_") as tmp:
        for k in range(args.repeats):
            for mode in args.modes:
                measure_mode(args, mode, tmp, k, runs)
        results = {m: mode_result(args, m, tmp, runs) for m in args.modes}
    headline = results[args.modes[0]]
    result.update(
        {
            "workload": {
                "num_requests": args.num_requests,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "max_num_seqs": 1024,
                "max_num_batched_tokens": 8192,
                "steady_min_running": STEADY_MIN_RUNNING,
            },
            "mode": args.modes[0],
            "runs_per_side": args.repeats,
            "statistic": "median over runs of each run's median steady-step cost",
            "modes": results,
            # The headline mode's figures, under the keys earlier results used.
            "llmsched": headline["llmsched"],
            "target_ms": 2.5,
        }
    )
    if "vllm" in headline:
        result["vllm"] = headline["vllm"]
        result["speedup_vs_vllm"] = headline["speedup_vs_vllm"]
        result["cpu_speedup_vs_vllm"] = headline["cpu_speedup_vs_vllm"]
    print_table(args.modes, results, args.repeats)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
