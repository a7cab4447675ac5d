#!/usr/bin/env python3
"""Colocated against disaggregated prefill/decode in the simulator: goodput under a TTFT/TPOT SLO.

llama-3-70b on 8 H100s (NVLink between them), every instance TP=2 (the
smallest TP that holds the bfloat16 weights), async scheduling as vLLM
0.33. Deployments with the same 8 GPUs: colocated (4 ordinary instances),
2P6D (1 prefill + 3 decode instances: 2 prefill GPUs, 6 decode GPUs) and
4P4D (2 + 2). A chat workload: Poisson arrivals, prompts 384-1152 tokens
(mean 768), outputs 128-384 (mean 256). Each request rate runs the same
requests through every deployment.

SLO attainment = the share of requests with TTFT <= 500 ms and TPOT <= 50
ms; goodput (DistServe's definition) = the highest request rate at which
at least 90% attain it, interpolated between the rates run. A tighter TPOT
SLO (30 ms) is reported from the same runs, since whether disaggregation
pays depends on how tight TPOT is.

    python benchmarks/simulator/pd_sim.py [--num-prompts 600] [--json results/pd_sim.json]
        [--plot docs/img/pd_sim.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.sim.deployment import DeploymentSpec, build_deployment  # noqa: E402
from llmsched.sim.pd import PDRun, parse_pd  # noqa: E402
from llmsched.sim.workload import synthetic_workload  # noqa: E402

DEPLOYMENTS = {"colocated": "colocated:4", "2P6D": "1P3D", "4P4D": "2P2D"}
SLOS = {
    "TTFT 500 / TPOT 50 ms": {"ttft": 500.0, "tpot": 50.0},
    "TTFT 500 / TPOT 30 ms": {"ttft": 500.0, "tpot": 30.0},
}
RATES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0)
TARGET = 0.9


def goodput(rates: list[float], attain: list[float]) -> float:
    """The highest rate with attainment >= TARGET, linear between grid points (0 if none)."""
    best = 0.0
    for i, (r, a) in enumerate(zip(rates, attain)):
        if a >= TARGET:
            best = r
            if i + 1 < len(rates) and attain[i + 1] < TARGET:
                r2, a2 = rates[i + 1], attain[i + 1]
                best = r + (r2 - r) * (a - TARGET) / (a - a2)
        elif best:
            break
    return best


def main() -> int:
    """Sweep rates for each deployment, print the table, write JSON and the plot."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=600)
    ap.add_argument("--json", default="results/pd_sim.json")
    ap.add_argument("--plot", default="docs/img/pd_sim.png")
    args = ap.parse_args()
    dep = build_deployment(
        DeploymentSpec(model="llama-3-70b", hardware="h100", tensor_parallel_size=2, async_scheduling=True)
    )
    print("\n".join(dep.describe()))
    runs: dict[str, list[dict]] = {name: [] for name in DEPLOYMENTS}
    t0 = time.perf_counter()
    for rate in RATES:
        wl = synthetic_workload(args.num_prompts, 768, 256, request_rate=rate, range_ratio=0.5, seed=7)
        for name, spec in DEPLOYMENTS.items():
            run = PDRun(dep, wl, parse_pd(spec))
            run.run()
            m = run.metrics
            s = m.summary(run.end_time)
            n = len(m)
            row = {
                "rate": rate,
                "throughput": s["request_throughput"],
                "median_ttft_ms": s["median_ttft_ms"],
                "p99_ttft_ms": s["p99_ttft_ms"],
                "median_tpot_ms": s["median_tpot_ms"],
                "p99_tpot_ms": s["p99_tpot_ms"],
                "attainment": {k: m.good_count(v) / n for k, v in SLOS.items()},
                "mean_transfer_ms": run.transfer_total * 1e3 / run.num_transfers
                if run.num_transfers
                else 0.0,
            }
            runs[name].append(row)
    wall = time.perf_counter() - t0
    table = {}
    for slo in SLOS:
        table[slo] = {
            name: goodput(list(RATES), [r["attainment"][slo] for r in rows]) for name, rows in runs.items()
        }
    print(f"\ngoodput (req/s at >= {TARGET:.0%} SLO attainment), {args.num_prompts} requests per rate")
    print(f"{'SLO':<24}" + "".join(f"{n:>12}" for n in DEPLOYMENTS))
    for slo, row in table.items():
        print(f"{slo:<24}" + "".join(f"{row[n]:>12.2f}" for n in DEPLOYMENTS))
    print("\nper rate: SLO attainment (TPOT 50 / TPOT 30), median TTFT ms, p99 TPOT ms")
    for i, rate in enumerate(RATES):
        cells = []
        for name in DEPLOYMENTS:
            r = runs[name][i]
            a = list(r["attainment"].values())
            cells.append(f"{name} {a[0]:.2f}/{a[1]:.2f} {r['median_ttft_ms']:.0f} {r['p99_tpot_ms']:.1f}")
        print(f"{rate:>5.1f} req/s  " + "  |  ".join(cells))
    print(
        f"\nmean KV transfer per request: {runs['2P6D'][0]['mean_transfer_ms']:.2f} ms; "
        f"simulated in {wall:.0f} s"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        result = record_cpu({"deployment": dep.to_dict(), "goodput": table, "runs": runs})
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    if args.plot:
        _plot(runs, table, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _plot(runs: dict[str, list[dict]], table: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SLOS), figsize=(11, 4), sharey=True)
    for ax, slo in zip(axes, SLOS):
        for name, rows in runs.items():
            ax.plot(
                [r["rate"] for r in rows],
                [100 * r["attainment"][slo] for r in rows],
                marker="o",
                label=f"{name} (goodput {table[slo][name]:.1f} req/s)",
            )
        ax.axhline(100 * TARGET, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"llama-3-70b, 8x H100: {slo}")
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("SLO attainment (%)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
