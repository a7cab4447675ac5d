#!/usr/bin/env python3
"""What each scheduling policy buys, in the simulator, against FCFS.

Four workloads (llama-3-8b on one simulated H100 unless told otherwise):

- bursty_chat: lognormal prompt and output lengths, gamma arrivals
  (burstiness 0.25) above the engine's capacity in bursts; 10% of requests
  are interactive (priority 0), the rest batch (priority 1).
- long_context_mix: 4% of prompts are 32k tokens among ~300-token ones;
  the KV cache holds about three long prompts.
- multi_tenant: four tenants, ``t0`` sending 10x the load of each other one,
  together twice what the engine serves.
- shared_prefix_rag: 64 documents of 2k tokens, each request one document
  plus a short question, on a cache that holds about a third of them.

Per policy: TTFT and TPOT p50/p99, goodput under the SLO (TTFT <= 2 s and
TPOT <= 100 ms), the longest wait for a first token, Jain's fairness index
over tenants (service normalised by each tenant's max-min fair share), and
one figure per workload that the policy targets (interactive p99 TTFT;
short-request p99 TTFT; prefix-cache hit rate). Prints a table, writes JSON
and a plot.

    python benchmarks/simulator/policy_study.py [--json results/policy_study.json]
        [--plot docs/img/policy_study.png]
    python benchmarks/simulator/policy_study.py --replot results/policy_study.json   # the plot again, no run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.bench.metrics import percentile_sorted  # noqa: E402
from llmsched.sim import simulate  # noqa: E402
from llmsched.sim.deployment import DeploymentSpec, build_deployment  # noqa: E402
from llmsched.sim.workload import Workload, arrival_times  # noqa: E402

POLICIES = [
    "fcfs",
    "sjf",
    "fair",
    "priority-preemptive",
    "skip-admission",
    "lpm",
    "slo",
    "fair+skip-admission",
]
SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.100


def _lognormal(rng: random.Random, n: int, median: float, sigma: float, lo: int, hi: int) -> array:
    return array("l", [min(max(int(rng.lognormvariate(math.log(median), sigma)), lo), hi) for _ in range(n)])


def bursty_chat(n: int, seed: int) -> tuple[Workload, dict]:
    """Chat lengths (lognormal), gamma-bursty arrivals, 10% interactive."""
    rng = random.Random(seed)
    arr = arrival_times(n, 10.0, 0.25, rng)
    ins = _lognormal(rng, n, 600, 1.0, 16, 8000)
    outs = _lognormal(rng, n, 180, 0.9, 8, 2000)
    prios = array("l", [0 if rng.random() < 0.1 else 1 for _ in range(n)])
    wl = Workload(arr, ins, outs, priorities=prios, request_rate=10.0, burstiness=0.25)
    return wl, {"max_num_seqs": 32}


def long_context_mix(n: int, seed: int) -> tuple[Workload, dict]:
    """A few 32k prompts among short ones on a cache holding about three of them."""
    rng = random.Random(seed)
    arr = arrival_times(n, 3.0, 1.0, rng)
    long = [rng.random() < 0.04 for _ in range(n)]
    ins = array("l", [32000 if lg else rng.randint(100, 500) for lg in long])
    outs = array("l", [rng.randint(50, 250) for _ in range(n)])
    wl = Workload(arr, ins, outs, request_rate=3.0)
    # A 32k context needs a model that has one: Qwen3-32B on two H100s.
    return wl, {
        "num_gpu_blocks": 6400,
        "max_model_len": 32768,
        "model": "qwen3-32b",
        "tensor_parallel_size": 2,
    }


def multi_tenant(n: int, seed: int) -> tuple[Workload, dict]:
    """Tenant t0 sends 10x the requests of each of t1..t3; all alike otherwise."""
    rng = random.Random(seed)
    arr = arrival_times(n, 45.0, 1.0, rng)
    tenants = [rng.choices(["t0", "t1", "t2", "t3"], weights=[10, 1, 1, 1])[0] for _ in range(n)]
    ins = array("l", [rng.randint(200, 1000) for _ in range(n)])
    outs = array("l", [rng.randint(100, 300) for _ in range(n)])
    wl = Workload(arr, ins, outs, tenants=tenants, request_rate=45.0)
    return wl, {"max_num_seqs": 48}


def shared_prefix_rag(n: int, seed: int) -> tuple[Workload, dict]:
    """64 documents of 2k tokens, each request one of them plus a short question."""
    rng = random.Random(seed)
    arr = arrival_times(n, 20.0, 0.5, rng)
    ins = array("l", [2048 + rng.randint(20, 120) for _ in range(n)])
    outs = array("l", [rng.randint(20, 120) for _ in range(n)])
    groups = array("l", [rng.randrange(64) for _ in range(n)])
    wl = Workload(arr, ins, outs, groups=groups, prefix_len=2048, request_rate=20.0, burstiness=0.5)
    return wl, {"num_gpu_blocks": 3000, "max_num_seqs": 32}


WORKLOADS = {
    "bursty_chat": bursty_chat,
    "long_context_mix": long_context_mix,
    "multi_tenant": multi_tenant,
    "shared_prefix_rag": shared_prefix_rag,
}


def jain(xs: list[float]) -> float:
    """Jain's fairness index of ``xs`` (1: all equal)."""
    s = sum(xs)
    q = sum(x * x for x in xs)
    return s * s / (len(xs) * q) if q else 1.0


def max_min_shares(demand: dict[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: each tenant gets min(demand, equal share of what is left)."""
    share: dict[str, float] = {}
    left = dict(demand)
    cap = capacity
    while left:
        each = cap / len(left)
        small = {t: d for t, d in left.items() if d <= each}
        if not small:
            share.update(dict.fromkeys(left, each))
            break
        for t, d in small.items():
            share[t] = d
            cap -= d
            del left[t]
    return share


def tenant_fairness(records: list[tuple], wl: Workload, horizon: float) -> float | None:
    """Jain's index of each tenant's tokens served by ``horizon`` over its max-min fair share."""
    if wl.tenants is None:
        return None
    demand: dict[str, float] = {}
    for i, t in enumerate(wl.tenants):
        if wl.arrivals[i] <= horizon:
            demand[t] = demand.get(t, 0.0) + wl.input_lens[i] + wl.output_lens[i]
    served = dict.fromkeys(demand, 0.0)
    for tenant, _sent, first, end, n_in, n_out in records:
        if first >= 0 and end <= horizon and tenant in served:
            served[tenant] += n_in + n_out
    fair = max_min_shares(demand, sum(served.values()))
    return jain([served[t] / fair[t] for t in demand if fair[t] > 0])


def figures(res, wl: Workload, name: str) -> dict:
    """The study's figures for one run."""
    recs = [r for r in res.requests if r[2] >= 0]
    ttft = sorted(r[2] - r[1] for r in recs)
    tpot = sorted((r[3] - r[2]) / (r[5] - 1) for r in recs if r[5] > 1)
    good = sum(
        1
        for r in recs
        if r[2] - r[1] <= SLO_TTFT_S and (r[5] <= 1 or (r[3] - r[2]) / (r[5] - 1) <= SLO_TPOT_S)
    )
    out = {
        "ttft_p50_s": percentile_sorted(ttft, 50),
        "ttft_p99_s": percentile_sorted(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile_sorted(tpot, 50),
        "tpot_p99_ms": 1e3 * percentile_sorted(tpot, 99),
        "goodput_rps": good / res.sim_duration_s,
        "max_wait_s": ttft[-1],
        "declined": res.num_declined,
        "preemptions": res.num_preemptions,
        "prefix_hit_rate": res.prefix_cache_hit_rate,
        "duration_s": res.sim_duration_s,
    }
    fair = tenant_fairness(res.requests, wl, wl.arrivals[-1])
    if fair is not None:
        out["jain"] = fair
    if name == "bursty_chat":
        # Records are by finish order; match interactive ones by sent time.
        hi = {wl.arrivals[i] for i in range(len(wl)) if wl.priorities[i] == 0}
        t = sorted(r[2] - r[1] for r in recs if r[1] in hi)
        out["interactive_ttft_p99_s"] = percentile_sorted(t, 99)
    if name == "multi_tenant":
        light = sorted(r[2] - r[1] for r in recs if r[0] != "t0")
        out["light_tenants_ttft_p99_s"] = percentile_sorted(light, 99)
    if name == "long_context_mix":
        t = sorted(r[2] - r[1] for r in recs if r[4] < 1000)
        out["short_ttft_p99_s"] = percentile_sorted(t, 99)
    return out


def run(name: str, policy: str, n: int, seed: int, model: str, hardware: str) -> dict:
    """One workload under one policy."""
    wl, knobs = WORKLOADS[name](n, seed)
    knobs = {"model": model, "hardware": hardware, **knobs}
    dep = build_deployment(DeploymentSpec(scheduling_policy=policy, **knobs))
    t0 = time.perf_counter()
    res = simulate(dep, wl, record_requests=True, fast_forward=True)
    out = figures(res, wl, name)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


# The figure each workload is built to move, and which way is better.
FOCUS = {
    "bursty_chat": ("ttft_p50_s", "p50 TTFT (s)"),
    "long_context_mix": ("short_ttft_p99_s", "p99 TTFT of short requests (s)"),
    "multi_tenant": ("jain", "Jain's index over tenants"),
    "shared_prefix_rag": ("ttft_p50_s", "p50 TTFT (s)"),
}
COLUMNS = [
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    ("goodput_rps", "goodput req/s", "{:.2f}"),
    ("max_wait_s", "max wait s", "{:.1f}"),
    ("jain", "Jain", "{:.3f}"),
]
EXTRA = {
    "bursty_chat": ("interactive_ttft_p99_s", "interactive TTFT p99 s"),
    "long_context_mix": ("short_ttft_p99_s", "short-request TTFT p99 s"),
    "multi_tenant": ("light_tenants_ttft_p99_s", "light tenants' TTFT p99 s"),
    "shared_prefix_rag": ("prefix_hit_rate", "prefix hit rate"),
}


def markdown(results: dict) -> str:
    """One table per workload, FCFS first."""
    lines = []
    for name, rows in results.items():
        key, label = EXTRA[name]
        lines.append(f"**{name}**\n")
        head = ["policy", *(c[1] for c in COLUMNS), label, "declined", "preemptions"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for policy, r in rows.items():
            cells = [policy]
            cells += [fmt.format(r[k]) if k in r else "-" for k, _, fmt in COLUMNS]
            cells += [f"{r[key]:.3g}", str(r["declined"]), str(r["preemptions"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Per workload: each policy's focus figure and p99 TTFT, and below them what it gave up.

    A policy that declines requests reports latency over the requests it
    served only, so the lower panel shows the declined requests (and the
    preemptions, recomputed work) beside the latency they bought.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(18, 9))
    FigureCanvasAgg(fig)
    grid = fig.subplots(2, len(results), sharex="col", gridspec_kw={"height_ratios": [3, 2]}, squeeze=False)
    for col, (name, rows) in enumerate(results.items()):
        ax, cost = grid[0][col], grid[1][col]
        key, label = FOCUS[name]
        policies = list(rows)
        xs = list(range(len(policies)))
        width = 0.4
        focus = [rows[p].get(key, 0.0) for p in policies]
        ax.bar([x - width / 2 for x in xs], focus, width, label=label)
        if key != "ttft_p99_s":
            ax2 = ax.twinx()
            ax2.bar(
                [x + width / 2 for x in xs],
                [rows[p]["ttft_p99_s"] for p in policies],
                width,
                color="tab:orange",
                label="p99 TTFT (s)",
            )
            ax2.set_ylabel("p99 TTFT (s)", color="tab:orange")
        # Flag the bars measured over fewer requests than were sent, on the
        # topmost axes so the other series' bars cannot cover the note.
        top = ax2 if key != "ttft_p99_s" else ax
        for x, p in zip(xs, policies):
            if rows[p]["declined"]:
                top.text(
                    x,
                    0.98,
                    f"{rows[p]['declined']}\ndeclined",
                    transform=top.get_xaxis_transform(),
                    ha="center",
                    va="top",
                    color="tab:red",
                    fontsize=8,
                    fontweight="bold",
                )
        ax.set_ylabel(label, color="tab:blue")
        ax.set_title(name)
        ax.margins(y=0.2)
        if key != "ttft_p99_s":
            ax2.margins(y=0.2)
        cost.bar(
            [x - width / 2 for x in xs],
            [rows[p]["declined"] for p in policies],
            width,
            color="tab:red",
            label="declined requests",
        )
        cost.bar(
            [x + width / 2 for x in xs],
            [rows[p]["preemptions"] for p in policies],
            width,
            color="tab:gray",
            label="preemptions",
        )
        cost.set_ylabel("requests declined / preemptions")
        cost.set_xticks(xs, policies, rotation=35, ha="right", fontsize=8)
        if col == 0:
            cost.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "Scheduling policies in the simulator. Top: the figure each workload targets (blue) and p99 TTFT "
        "(orange), over the requests served.\nBottom: what each policy gave up for it: requests declined "
        "(red, never served, not in the latency above) and preemptions (gray, recomputed work)."
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> int:
    """Run every policy on every workload; print, write JSON, plot."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", default=str(ROOT / "results" / "policy_study.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "policy_study.png"))
    ap.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    ap.add_argument("--replot", default=None, help="draw --plot from this result JSON instead of running")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["results"], args.plot)
        print(f"wrote {args.plot}")
        return 0
    results: dict = {}
    for name in args.workloads.split(","):
        results[name] = {}
        for policy in args.policies.split(","):
            results[name][policy] = run(name, policy, args.num_requests, args.seed, args.model, args.hardware)
            r = results[name][policy]
            print(f"{name:18s} {policy:22s} " + " ".join(f"{k}={v:.3g}" for k, v in r.items()), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        result = record_cpu({"num_requests": args.num_requests, "seed": args.seed, "results": results})
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    table = markdown(results)
    print()
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
