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

    python benchmarks/policy_study.py [--json results/policy_study.json] [--plot docs/policy_study.png]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

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
    arr = arrival_times(n, 14.0, 0.25, rng)
    ins = _lognormal(rng, n, 600, 1.0, 16, 8000)
    outs = _lognormal(rng, n, 180, 0.9, 8, 2000)
    prios = array("l", [0 if rng.random() < 0.1 else 1 for _ in range(n)])
    wl = Workload(arr, ins, outs, priorities=prios, request_rate=14.0, burstiness=0.25)
    return wl, {"max_num_seqs": 64}


def long_context_mix(n: int, seed: int) -> tuple[Workload, dict]:
    """A few 32k prompts among short ones on a cache holding about three of them."""
    rng = random.Random(seed)
    arr = arrival_times(n, 6.0, 1.0, rng)
    long = [rng.random() < 0.04 for _ in range(n)]
    ins = array("l", [32000 if lg else rng.randint(100, 500) for lg in long])
    outs = array("l", [rng.randint(50, 250) for _ in range(n)])
    wl = Workload(arr, ins, outs, request_rate=6.0)
    return wl, {"num_gpu_blocks": 6400, "max_model_len": 32768}


def multi_tenant(n: int, seed: int) -> tuple[Workload, dict]:
    """Tenant t0 sends 10x the requests of each of t1..t3; all alike otherwise."""
    rng = random.Random(seed)
    arr = arrival_times(n, 30.0, 1.0, rng)
    tenants = [rng.choices(["t0", "t1", "t2", "t3"], weights=[10, 1, 1, 1])[0] for _ in range(n)]
    ins = array("l", [rng.randint(200, 1000) for _ in range(n)])
    outs = array("l", [rng.randint(100, 300) for _ in range(n)])
    wl = Workload(arr, ins, outs, tenants=tenants, request_rate=30.0)
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
    if name == "long_context_mix":
        t = sorted(r[2] - r[1] for r in recs if r[4] < 1000)
        out["short_ttft_p99_s"] = percentile_sorted(t, 99)
    return out


def run(name: str, policy: str, n: int, seed: int, model: str, hardware: str) -> dict:
    """One workload under one policy."""
    wl, knobs = WORKLOADS[name](n, seed)
    dep = build_deployment(DeploymentSpec(model=model, hardware=hardware, scheduling_policy=policy, **knobs))
    t0 = time.perf_counter()
    res = simulate(dep, wl, record_requests=True, fast_forward=True)
    out = figures(res, wl, name)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


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
    ap.add_argument("--plot", default=str(ROOT / "docs" / "policy_study.png"))
    args = ap.parse_args()
    results: dict = {}
    for name in args.workloads.split(","):
        results[name] = {}
        for policy in args.policies.split(","):
            results[name][policy] = run(name, policy, args.num_requests, args.seed, args.model, args.hardware)
            r = results[name][policy]
            print(f"{name:18s} {policy:22s} " + " ".join(f"{k}={v:.3g}" for k, v in r.items()), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"num_requests": args.num_requests, "seed": args.seed, "results": results}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
