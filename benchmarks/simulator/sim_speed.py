#!/usr/bin/env python3
"""How fast the simulator runs: wall and CPU time per simulated request, and where it goes.

Workload (the acceptance figure): 10,000 requests, Poisson arrivals at 4
req/s, 1024-token prompts, 64 output tokens, --max-num-seqs 128, llama-3-8b
on one H100, prefix caching on, async scheduling (vLLM's defaults, and
``llmsched simulate``'s); each rate also runs with sync scheduling beside
it, and the async / sync wall ratio is printed. Each run
reports wall time, this process's CPU time (less sensitive to a busy shared
machine), microseconds per request, peak RSS, and the split between the
scheduler (schedule() + update_from_output() of the steps built), the
SimExecutor (cost model included), and the rest of the simulation loop
(arrivals, request creation, metrics, and the steps applied without being
built: plain decode runs and decode-cohort steps, scheduler work included).

Baseline in the same run: the first rate is also simulated step by step
in both modes (``fast_forward=False``: every step's batch built and priced,
every async engine call taken one by one), which gives the same figures;
the ratios are printed. If Vidur is installed beside the
project (``import vidur`` works), it is run on the same workload and timed.

    python benchmarks/simulator/sim_speed.py                      # 10,000 requests at 4, 30, inf req/s
    python benchmarks/simulator/sim_speed.py --million            # plus 1,000,000 requests
    python benchmarks/simulator/sim_speed.py --profile 3000       # where the time goes (cProfile)
    python benchmarks/simulator/sim_speed.py --compare-src /tmp/base/src --pairs 5   # ratio vs another tree
    python benchmarks/simulator/sim_speed.py --compare-src /tmp/base/src --sync  # the same, sync

``--compare-src`` times another source tree (an older commit's ``src``,
e.g. from ``git archive``) against this one on the first rate, alternating
the two in fresh processes so that a shared machine's load hits both
alike; it prints each pair and the ratio of the fastest runs.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import math
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# --compare-src runs each side in a child with SIM_SPEED_SRC naming the tree to import.
SRC = os.environ.get("SIM_SPEED_SRC") or str(ROOT / "src")
sys.path.insert(0, SRC)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.engine.engine_core import EngineCore, EngineStep  # noqa: E402
from llmsched.sim import DeploymentSpec, build_deployment, simulate, synthetic_workload  # noqa: E402


class StepClock:
    """Sums the engine's own per-step timings (schedule, execute, update) while installed."""

    def __init__(self) -> None:
        self.schedule_ns = self.execute_ns = self.update_ns = 0
        self._orig = EngineCore.step

    def __enter__(self) -> StepClock:
        orig, me = self._orig, self

        def step(engine: EngineCore) -> EngineStep | None:
            es = orig(engine)
            if es is None:
                return es  # async: a step put in flight, none applied yet
            me.schedule_ns += es.schedule_ns
            me.execute_ns += es.execute_ns
            me.update_ns += es.update_ns
            return es

        EngineCore.step = step
        return self

    def __exit__(self, *exc: object) -> None:
        EngineCore.step = self._orig


def run_once(
    args: argparse.Namespace,
    num_requests: int,
    rate: float,
    fast_forward: bool = True,
    async_scheduling: bool = True,
) -> dict:
    """One simulation; timings and figures."""
    dep = build_deployment(
        DeploymentSpec(
            model=args.model,
            hardware=args.hardware,
            max_num_seqs=args.max_num_seqs,
            prefix_caching_hash_algo=args.hash_algo,
            async_scheduling=async_scheduling,
        )
    )
    wl = synthetic_workload(num_requests, args.input_len, args.output_len, request_rate=rate, seed=0)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    with StepClock() as clock:
        res = simulate(dep, wl, fast_forward=fast_forward)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    sched_s = (clock.schedule_ns + clock.update_ns) / 1e9
    exec_s = clock.execute_ns / 1e9
    return {
        "num_requests": num_requests,
        "request_rate": rate if not math.isinf(rate) else "inf",
        "fast_forward": fast_forward,
        "async_scheduling": async_scheduling,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "wall_us_per_request": round(wall * 1e6 / num_requests, 1),
        "cpu_us_per_request": round(cpu * 1e6 / num_requests, 1),
        "steps": res.num_steps,
        "scheduler_s": round(sched_s, 3),
        "scheduler_share": round(sched_s / wall, 3),
        "executor_s": round(exec_s, 3),
        "loop_other_s": round(wall - sched_s - exec_s, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "completed": res.summary["completed"],
        "simulated_duration_s": round(res.sim_duration_s, 2),
        "request_throughput": round(res.summary["request_throughput"], 3),
        "mean_ttft_ms": round(res.summary["mean_ttft_ms"], 2),
        "mean_tpot_ms": round(res.summary["mean_tpot_ms"], 3),
        "prefix_caching_hash_algo": dep.scheduler_config.prefix_caching_hash_algo,
    }


# Figures that must not depend on how the steps were applied.
FIGURES = ("steps", "completed", "mean_ttft_ms", "mean_tpot_ms")


def fastest(runs: list[dict]) -> dict:
    """The fastest run by wall time, with every run's wall time."""
    best = min(runs, key=lambda r: r["wall_s"])
    best["all_wall_s"] = [r["wall_s"] for r in runs]
    return best


def run_vidur(args: argparse.Namespace, num_requests: int, rate: float) -> dict | None:
    """Vidur's simulator on the same workload, timed (None when Vidur is not installed)."""
    if importlib.util.find_spec("vidur") is None:
        print("Vidur is not installed beside the project: no Vidur figure")
        return None
    cmd = [
        sys.executable, "-m", "vidur.main",
        "--replica_config_device", args.hardware,
        "--replica_config_model_name", "meta-llama/Meta-Llama-3-8B",
        "--cluster_config_num_replicas", "1",
        "--replica_config_tensor_parallel_size", "1",
        "--replica_config_num_pipeline_stages", "1",
        "--request_generator_config_type", "synthetic",
        "--synthetic_request_generator_config_num_requests", str(num_requests),
        "--length_generator_config_type", "fixed",
        "--fixed_request_length_generator_config_prefill_tokens", str(args.input_len),
        "--fixed_request_length_generator_config_decode_tokens", str(args.output_len),
        "--interval_generator_config_type", "poisson",
        "--poisson_request_interval_generator_config_qps", str(rate),
        "--replica_scheduler_config_type", "vllm",
        "--vllm_scheduler_config_batch_size_cap", str(args.max_num_seqs),
    ]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode:
        print(f"Vidur failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        return None
    return {"wall_s": round(wall, 3), "command": " ".join(cmd[1:])}


def show(r: dict) -> None:
    """One line per run."""
    print(
        f"{'async' if r['async_scheduling'] else 'sync '} {'' if r['fast_forward'] else 'step-by-step '}"
        f"{r['num_requests']:>9} req @ {r['request_rate']!s:>5} req/s: wall {r['wall_s']:8.2f} s "
        f"({r['wall_us_per_request']:6.1f} us/req), cpu {r['cpu_s']:8.2f} s "
        f"({r['cpu_us_per_request']:6.1f} us/req), {r['steps']:>8} steps, scheduler "
        f"{100 * r['scheduler_share']:.0f}% / executor {r['executor_s']:.2f} s / "
        f"loop {r['loop_other_s']:.2f} s, "
        f"rss {r['peak_rss_mb']:.0f} MB"
    )


def profile(args: argparse.Namespace, num_requests: int) -> list[dict]:
    """Cumulative time of the functions the simulation spends most in (cProfile)."""
    dep = build_deployment(
        DeploymentSpec(
            model=args.model,
            hardware=args.hardware,
            max_num_seqs=args.max_num_seqs,
            async_scheduling=not args.sync,
        )
    )
    wl = synthetic_workload(
        num_requests, args.input_len, args.output_len, request_rate=args.profile_rate, seed=0
    )
    prof = cProfile.Profile()
    prof.enable()
    simulate(dep, wl)
    prof.disable()
    stats = pstats.Stats(prof)
    total = max(v[3] for v in stats.stats.values())
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        if "llmsched" not in file:
            continue
        rows.append(
            {
                "function": f"{file.split('src/')[-1]}:{line}({func})",
                "calls": ncalls,
                "self_share": round(tottime / total, 3),
                "cum_share": round(cumtime / total, 3),
            }
        )
    rows.sort(key=lambda r: -r["self_share"])
    return rows[:25]


def one_run_in_child(args: argparse.Namespace, src: str, num_requests: int, rate: float) -> dict:
    """``run_once`` in a fresh interpreter importing the tree at ``src``."""
    cmd = [
        sys.executable, __file__, "--one", f"{num_requests},{rate}",
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--max-num-seqs", str(args.max_num_seqs), "--model", args.model,
        "--hardware", args.hardware, "--hash-algo", args.hash_algo, *(["--sync"] if args.sync else []),
    ]  # fmt: skip
    env = dict(os.environ, SIM_SPEED_SRC=src)
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace, num_requests: int, rate: float) -> dict:
    """This tree against ``--compare-src``, alternating in fresh processes; the ratios of the fastest."""
    mine, base = [], []
    for k in range(args.pairs):
        base.append(one_run_in_child(args, str(Path(args.compare_src).resolve()), num_requests, rate))
        mine.append(one_run_in_child(args, str(ROOT / "src"), num_requests, rate))
        b, m = base[-1], mine[-1]
        print(
            f"pair {k + 1}: baseline wall {b['wall_s']:.2f} s cpu {b['cpu_s']:.2f} s, "
            f"this tree wall {m['wall_s']:.2f} s cpu {m['cpu_s']:.2f} s "
            f"(cpu ratio {b['cpu_s'] / m['cpu_s']:.3f})"
        )
    same = all(b[key] == m[key] for b, m in zip(base, mine) for key in FIGURES)
    out = {
        "baseline_src": args.compare_src,
        "async_scheduling": not args.sync,
        "baseline_wall_s": [r["wall_s"] for r in base],
        "wall_s": [r["wall_s"] for r in mine],
        "baseline_cpu_s": [r["cpu_s"] for r in base],
        "cpu_s": [r["cpu_s"] for r in mine],
        "wall_ratio": round(min(r["wall_s"] for r in base) / min(r["wall_s"] for r in mine), 3),
        "cpu_ratio": round(min(r["cpu_s"] for r in base) / min(r["cpu_s"] for r in mine), 3),
        "figures_equal": same,
    }
    print(
        f"baseline / this tree, fastest of {args.pairs}: wall {out['wall_ratio']:.3f}x, "
        f"cpu {out['cpu_ratio']:.3f}x; figures {'equal' if same else 'DIFFERENT'}"
    )
    return out


def one_or_compare(args: argparse.Namespace) -> int:
    """``--one`` (a child's single run, printed as JSON) or ``--compare-src`` (written to --json)."""
    if args.one:
        n, rate = args.one.split(",")
        print(json.dumps(run_once(args, int(n), float(rate), async_scheduling=not args.sync)))
        return 0
    result = {"compare": compare(args, args.num_requests, float(args.rates.split(",")[0]))}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record_cpu(result), f, indent=2)
    print(f"wrote {args.json}")
    return 0


def main() -> int:
    """Run the benchmark, print the figures, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument(
        "--rates",
        default="4,30,inf",
        help="request rates for the main runs (default 4,30,inf; the first is "
        "the acceptance figure and also runs step by step as the baseline)",
    )
    ap.add_argument("--no-baseline", action="store_true", help="skip the step-by-step baseline runs")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--hash-algo", default="auto", help="prefix-cache hash (auto: xxh3_128 if installed)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per rate; the fastest is reported")
    ap.add_argument("--million", action="store_true", help="also simulate 1,000,000 requests (minutes)")
    ap.add_argument("--million-rate", default="30")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile a run of N requests")
    ap.add_argument("--profile-rate", type=float, default=4.0, help="request rate of the profiled run")
    ap.add_argument("--json", default=str(ROOT / "results" / "sim_speed.json"))
    ap.add_argument(
        "--compare-src",
        metavar="DIR",
        help="another tree's src directory: time it against this one on the first rate, "
        "alternating in fresh processes, and print the ratio (then exit)",
    )
    ap.add_argument("--pairs", type=int, default=3, help="alternating pairs for --compare-src")
    ap.add_argument(
        "--sync",
        action="store_true",
        help="--compare-src and --profile with sync scheduling (default: async)",
    )
    ap.add_argument("--one", metavar="N,RATE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one or args.compare_src:
        return one_or_compare(args)

    result: dict = {
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_num_seqs": args.max_num_seqs,
            "model": args.model,
            "hardware": args.hardware,
            "arrivals": "Poisson",
        },
        "target": "10,000 requests at 4 req/s in <= 1.4 s wall; 1,000,000 in <= 60 s (default mode: async)",
        "runs": [],
    }
    for k, rate_text in enumerate(args.rates.split(",")):
        rate = float(rate_text)
        best = {}
        for mode in (True, False):
            runs, base = [], []
            for _ in range(args.repeats):
                # Alternated, so that a shared machine's load hits both alike.
                runs.append(run_once(args, args.num_requests, rate, async_scheduling=mode))
                if k == 0 and not args.no_baseline:
                    base.append(run_once(args, args.num_requests, rate, False, async_scheduling=mode))
            for r in runs + base:
                show(r)
            best[mode] = fastest(runs)
            if base:
                name = "async" if mode else "sync"
                b = fastest(base)
                same = all(b[key] == best[mode][key] for key in FIGURES)
                result[f"step_by_step_{name}"] = b
                result[f"speedup_vs_step_by_step_{name}"] = ratio = round(
                    b["wall_s"] / best[mode]["wall_s"], 2
                )
                print(
                    f"{name}: {ratio:.2f}x the step-by-step loop's wall ({b['wall_s']:.2f} -> "
                    f"{best[mode]['wall_s']:.2f} s), figures {'equal' if same else 'DIFFERENT'}"
                )
        a, s_ = best[True], best[False]
        a["sync"] = s_
        a["async_over_sync_wall"] = round(a["wall_s"] / s_["wall_s"], 3)
        a["async_over_sync_cpu"] = round(a["cpu_s"] / s_["cpu_s"], 3)
        result["runs"].append(a)
        print(
            f"{a['request_rate']!s:>5} req/s: async {a['wall_s']:.2f} s, sync {s_['wall_s']:.2f} s wall "
            f"(async / sync: wall {a['async_over_sync_wall']:.2f}, cpu {a['async_over_sync_cpu']:.2f})"
        )
    vidur = run_vidur(args, args.num_requests, float(args.rates.split(",")[0]))
    if vidur is not None:
        result["vidur"] = vidur
        print(f"Vidur on the same workload: wall {vidur['wall_s']:.2f} s")
    if args.million:
        r = run_once(args, 1_000_000, float(args.million_rate))
        show(r)
        result["million"] = r
    if args.profile:
        rows = profile(args, args.profile)
        result["profile"] = rows
        print(f"\nwhere a run of {args.profile} requests spends its time (share of the whole run, cProfile):")
        for row in rows[:15]:
            share = f"self {100 * row['self_share']:5.1f}%  cum {100 * row['cum_share']:5.1f}%"
            print(f"  {share}  {row['function']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record_cpu(result), f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
