#!/usr/bin/env python3
"""Balance scheduling and prefill cadence on a simulated DP + EP MoE deployment.

The reference scenario: DeepSeek-V3 on H100s, 4 data-parallel ranks with
expert parallelism over all GPUs, ``--max-num-seqs 32`` per rank (128 in
flight), 512 requests of 3500 prompt and 1500 output tokens, all sent at
once. Each scenario runs three policies on the same workload: the baseline,
``--balance-scheduling``, and ``--prefill-schedule-interval N``; the table
has the published table's columns (mean TPOT, mean TTFT, output
throughput) and the published figures for comparison.

Scenarios: ``reference`` is exactly the reference command. ``varied``
lets prompt and output lengths vary +-30% (``--range-ratio 0.3``, as
outputs ending at EOS do), which is what puts the ranks out of phase.
``varied-128`` also keeps 128 requests in flight from the client
(``--max-concurrency 128``), so TTFT measures the engine, not the queue;
``reference-128`` does that with the fixed lengths.

The second table says where the time went: lock-steps carrying a prefill
(they stall every rank's decodes), how the steps launched their kernels
(a CUDA graph for decode-only steps within the capture size, eagerly for
the rest: the group runs in the lowest mode any rank needs), the share of
time spent on eager launches, how full the 128 request slots were, and
how many requests were routed to a rank at its cap while another had room
(with ``--api-server-count``, routing follows vLLM's 100 ms snapshots).
The cost-model flags (``--cuda-graph-max-tokens``, ``--launch-latency-us``,
``--kernels-per-layer``) are ``llmsched simulate``'s, for what-ifs.

    python benchmarks/simulator/dp_balance.py [--scenarios reference,varied] [--interval 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.engine.dp import DPConfig  # noqa: E402
from llmsched.executor.sim.cost_model import LAUNCH_MODE_NAMES  # noqa: E402
from llmsched.sim import DeploymentSpec, build_deployment, synthetic_workload  # noqa: E402
from llmsched.sim.frontend import DEFAULT_TOKEN_S, Frontend  # noqa: E402
from llmsched.sim.runner import simulate  # noqa: E402

# DeepSeek-V3.1, 3500/1500 tokens, 512 requests, batch 128, as published in
# vllm-ascend PR #5212 (vLLM RFC #29722). It is a vLLM-Ascend feature, so
# presumably measured on Ascend NPUs rather than H100s: compare the changes,
# not the absolute figures.
PUBLISHED = {
    "baseline": {"mean_tpot_ms": 86.9, "mean_ttft_s": 6.6, "output_throughput": 1297.0},
    "balance": {"mean_tpot_ms": 70.6, "mean_ttft_s": 7.0, "output_throughput": 1531.0},
}
SCENARIOS = {
    "reference": {"range_ratio": 0.0, "max_concurrency": None},
    "varied": {"range_ratio": 0.3, "max_concurrency": None},
    "varied-128": {"range_ratio": 0.3, "max_concurrency": 128},
    "reference-128": {"range_ratio": 0.0, "max_concurrency": 128},
}
DEFAULT_SCENARIOS = ("reference", "varied", "varied-128")


def run(args: argparse.Namespace, scenario: str, policy: str) -> dict:
    """One simulation; returns the published columns plus the DP figures."""
    sc = SCENARIOS[scenario]
    deployment = build_deployment(
        DeploymentSpec(
            model=args.model,
            hardware=args.hardware,
            data_parallel_size=args.data_parallel_size,
            tensor_parallel_size=None,
            max_num_seqs=args.max_num_seqs,
            cuda_graph_max_tokens=args.cuda_graph_max_tokens,
            launch_latency_us=args.launch_latency_us,
            kernels_per_layer=args.kernels_per_layer,
        )
    )
    cm = deployment.cost_model
    workload = synthetic_workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        request_rate=math.inf,
        range_ratio=sc["range_ratio"],
        seed=args.seed,
    )
    dp = DPConfig(
        data_parallel_size=args.data_parallel_size,
        lockstep=True,
        balance_scheduling=policy == "balance",
        prefill_schedule_interval=args.interval if policy == "cadence" else 1,
    )
    t0 = time.perf_counter()
    frontend = None
    if args.api_server_count:
        # Tokenizing only, as docs/data-parallel.md's figures were made (no per-request or output cost).
        frontend = Frontend(args.api_server_count, args.api_server_us_per_token / 1e6, 0.0, 0.0)
    res = simulate(
        deployment,
        workload,
        dp=dp,
        max_concurrency=sc["max_concurrency"],
        record_series=True,
        frontend=frontend,
    )
    s = res.summary
    figures = res.data_parallel or {}
    # Where the time goes: steps carrying a prefill stall every rank's decodes.
    ser = res.series
    assert ser is not None
    total = sum(ser.duration) or 1.0
    prefill_time = sum(d for p, d in zip(ser.prefill_tokens, ser.duration) if p)
    mean_running = sum(n * d for n, d in zip(ser.num_running, ser.duration)) / total
    modes = figures.get("launch_modes", dict.fromkeys(LAUNCH_MODE_NAMES, 0))
    launch_time = modes["eager"] * cm.eager_launch_s + modes["piecewise"] * cm.piecewise_launch_s
    return {
        "scenario": scenario,
        "policy": policy,
        "mean_tpot_ms": s["mean_tpot_ms"],
        "mean_ttft_s": s["mean_ttft_ms"] / 1e3,
        "output_throughput": s["output_throughput"],
        "duration_s": s["duration"],
        "p99_tpot_ms": s["p99_tpot_ms"],
        "num_steps": res.num_steps,
        "prefill_steps": sum(1 for p in ser.prefill_tokens if p),
        "prefill_time_share": prefill_time / total,
        "mean_running": mean_running,
        "slot_occupancy": mean_running / (args.data_parallel_size * args.max_num_seqs),
        "launch_modes": modes,
        "launch_time_share": launch_time / total,
        "gate_held_rank_steps": sum(p["gate_held_steps"] for p in figures.get("per_rank", [])),
        "throttled_rank_steps": sum(p["throttled_steps"] for p in figures.get("per_rank", [])),
        "sent_to_full_rank": figures.get("sent_to_full_rank", 0),
        "wall_s": time.perf_counter() - t0,
        "deployment": deployment.describe()[1].strip(),
        "launches": deployment.describe()[-1].strip(),
        "cost_model": deployment.to_dict()["launch"],
    }


def table(rows: list[dict], interval: int) -> str:
    """Markdown table in the published table's columns, changes against each scenario's baseline."""
    label = {"baseline": "baseline", "balance": "balance scheduling", "cadence": f"prefill every {interval}"}
    out = [
        "| scenario | policy | mean TPOT (ms) | mean TTFT (s) | output throughput (tok/s) | vs baseline |",
        "|---|---|---|---|---|---|",
    ]
    base = {r["scenario"]: r for r in rows if r["policy"] == "baseline"}
    for r in rows:
        b = base.get(r["scenario"])
        delta = ""
        if b is not None and r is not b:
            delta = (
                f"TPOT {100 * (r['mean_tpot_ms'] / b['mean_tpot_ms'] - 1):+.1f}%, "
                f"TTFT {100 * (r['mean_ttft_s'] / b['mean_ttft_s'] - 1):+.1f}%, "
                f"throughput {100 * (r['output_throughput'] / b['output_throughput'] - 1):+.1f}%"
            )
        out.append(
            f"| {r['scenario']} | {label[r['policy']]} | {r['mean_tpot_ms']:.1f} | {r['mean_ttft_s']:.2f} | "
            f"{r['output_throughput']:.0f} | {delta} |"
        )
    pb, pl = PUBLISHED["baseline"], PUBLISHED["balance"]
    out.append(
        f"| published (DeepSeek-V3.1) | baseline | {pb['mean_tpot_ms']} | {pb['mean_ttft_s']} | "
        f"{pb['output_throughput']:.0f} | |"
    )
    out.append(
        f"| published (DeepSeek-V3.1) | balance scheduling | {pl['mean_tpot_ms']} | {pl['mean_ttft_s']} | "
        f"{pl['output_throughput']:.0f} | TPOT {100 * (pl['mean_tpot_ms'] / pb['mean_tpot_ms'] - 1):+.1f}%, "
        f"TTFT {100 * (pl['mean_ttft_s'] / pb['mean_ttft_s'] - 1):+.1f}%, throughput "
        f"{100 * (pl['output_throughput'] / pb['output_throughput'] - 1):+.1f}% |"
    )
    return "\n".join(out)


def why_table(rows: list[dict], interval: int) -> str:
    """Where the time went: steps carrying prefill (they stall every rank), slots in use, misroutes."""
    label = {"baseline": "baseline", "balance": "balance scheduling", "cadence": f"prefill every {interval}"}
    out = [
        "| scenario | policy | group steps | steps with a prefill | time in them | "
        "graph / piecewise / eager steps | time launching eagerly | slots in use | "
        "rank-steps held by the gate | sent to a full rank |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["launch_modes"]
        out.append(
            f"| {r['scenario']} | {label[r['policy']]} | {r['num_steps']} | {r['prefill_steps']} | "
            f"{100 * r['prefill_time_share']:.0f}% | {m['graph']} / {m['piecewise']} / {m['eager']} | "
            f"{100 * r['launch_time_share']:.1f}% | {100 * r['slot_occupancy']:.1f}% | "
            f"{r['gate_held_rank_steps']} | {r['sent_to_full_rank']} |"
        )
    return "\n".join(out)


def main() -> int:
    """Run the scenarios, print the table, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated of {', '.join(SCENARIOS)} (default {','.join(DEFAULT_SCENARIOS)})",
    )
    ap.add_argument("--interval", type=int, default=4, help="--prefill-schedule-interval of the cadence row")
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--data-parallel-size", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=3500)
    ap.add_argument("--output-len", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=None, help="as in llmsched simulate")
    ap.add_argument("--launch-latency-us", type=float, default=None, help="as in llmsched simulate")
    ap.add_argument("--kernels-per-layer", type=float, default=None, help="as in llmsched simulate")
    ap.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="model API servers in front of the engine (as llmsched simulate)",
    )
    ap.add_argument("--api-server-us-per-token", type=float, default=DEFAULT_TOKEN_S * 1e6)
    ap.add_argument("--json", default=str(ROOT / "results" / "dp_balance.json"))
    args = ap.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    rows = []
    for sc in scenarios:
        for policy in ("baseline", "balance", "cadence"):
            r = run(args, sc, policy)
            rows.append(r)
            print(
                f"{sc:>11} {policy:>8}: TPOT {r['mean_tpot_ms']:.1f} ms, TTFT {r['mean_ttft_s']:.2f} s, "
                f"{r['output_throughput']:.0f} tok/s ({r['wall_s']:.1f} s wall)",
                file=sys.stderr,
            )
    print(rows[0]["deployment"])
    print(rows[0]["launches"])
    print(f"{args.num_prompts} requests of {args.input_len}/{args.output_len} tokens, sent at once")
    if args.api_server_count:
        print(
            f"through {args.api_server_count} API server(s) at {args.api_server_us_per_token:g} us per "
            "prompt "
            "token: requests reach the ranks over time"
        )
    print(table(rows, args.interval))
    print()
    print(why_table(rows, args.interval))
    result = record_cpu(
        {
            "published": PUBLISHED,
            "interval": args.interval,
            "api_server_count": args.api_server_count,
            "api_server_us_per_token": args.api_server_us_per_token if args.api_server_count else None,
            "rows": rows,
        }
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
