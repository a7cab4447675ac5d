#!/usr/bin/env python3
"""Does the torch executor rank the policies as the simulator does? Two small workloads on this CPU.

A scaled-down chat mix with lognormal lengths (FCFS vs sjf, p50 TTFT) and
a multi-tenant mix (FCFS vs fair, the light tenants' p99 TTFT) run on the
TorchExecutor with the small random-weight Llama of e2e_cpu.py on the wall
clock, and in the simulator on the ``cpu`` profile with the same scheduler
config. Every request is sent at once, and TTFTs are compared as fractions
of the run's makespan: on a shared CPU the real step times drift with other
load by more than the policies differ, and a queue built up front with
scale-free figures makes the ranking depend on the order the policy chose,
not on how busy the machine was. The simulator's ranking is confirmed when
the same policy wins on both.

    python benchmarks/features/policy_study_torch.py [--json results/policy_study_torch.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))

from hostcpu import record_cpu  # noqa: E402
from small_llama import SMALL, build_model, greedy, on_a_thread  # noqa: E402

from llmsched.bench.metrics import percentile_sorted  # noqa: E402
from llmsched.core import SchedulerConfig  # noqa: E402
from llmsched.engine import EngineCore  # noqa: E402
from llmsched.executor.torch import TorchExecutor  # noqa: E402
from llmsched.sim import DeploymentSpec, SimRequest, Workload, build_deployment, simulate  # noqa: E402

BUDGET = 256
SEQS = 8


def bursty(seed: int, n: int) -> Workload:
    """Lognormal lengths, bursty arrivals."""
    rng = random.Random(seed)
    arr = array("d", [0.0] * n)
    ins = array("l", [min(max(int(rng.lognormvariate(math.log(120), 1.0)), 8), 1200) for _ in range(n)])
    outs = array("l", [min(max(int(rng.lognormvariate(math.log(16), 0.8)), 2), 96) for _ in range(n)])
    return _with_tokens(Workload(arr, ins, outs), rng)


def tenants(seed: int, n: int) -> Workload:
    """t0 sends 10x the requests of each of t1..t3."""
    rng = random.Random(seed)
    arr = array("d", [0.0] * n)
    ts = [rng.choices(["t0", "t1", "t2", "t3"], weights=[10, 1, 1, 1])[0] for _ in range(n)]
    ins = array("l", [rng.randint(60, 200) for _ in range(n)])
    outs = array("l", [rng.randint(8, 24) for _ in range(n)])
    return _with_tokens(Workload(arr, ins, outs, tenants=ts), rng)


def _with_tokens(wl: Workload, rng: random.Random) -> Workload:
    wl.token_ids = [[rng.randrange(SMALL["vocab_size"]) for _ in range(k)] for k in wl.input_lens]
    return wl


def run_real(ex: TorchExecutor, config: SchedulerConfig, wl: Workload, tag: str) -> list[tuple]:
    """The workload on the wall clock; (tenant, sent, first token, end, prompt, output) per request."""
    engine = EngineCore(config, ex)
    engine.scheduler.clock = lambda: time.perf_counter() - t0
    records: list[tuple] = []
    n, nxt = len(wl), 0
    t0 = time.perf_counter()
    while len(records) < n:
        now = time.perf_counter() - t0
        while nxt < n and wl.arrivals[nxt] <= now:
            t = wl.tenants[nxt] if wl.tenants is not None else None
            r = SimRequest(
                f"{tag}-{nxt}",
                wl.prompt(nxt),
                greedy(wl.output_lens[nxt]),
                arrival_time=wl.arrivals[nxt],
                sent_time=wl.arrivals[nxt],
                tenant=t,
            )
            engine.add_request(r)
            nxt += 1
        if not engine.has_requests():
            time.sleep(max(0.0, wl.arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        es = engine.step()
        end = time.perf_counter() - t0
        for req, toks in zip(es.scheduler_output.scheduled, es.model_output.sampled_token_ids):
            if toks and req.first_token_time < 0.0:
                req.first_token_time = end
        for r in es.outputs.finished:
            records.append(
                (r.tenant, r.sent_time, r.first_token_time, end, r.num_prompt_tokens, r.num_output_tokens)
            )
    while engine.has_requests():
        # Tell the executor about the last finished requests: it frees their rows.
        engine.step()
    return records


def figures(records: list[tuple], wl: Workload) -> dict:
    """p50 and p99 TTFT; with tenants, the light tenants' p99 TTFT; each also over the makespan."""
    ttft = sorted(r[2] - r[1] for r in records)
    makespan = max(r[3] for r in records)
    out = {
        "makespan_s": makespan,
        "ttft_p50_s": percentile_sorted(ttft, 50),
        "ttft_p99_s": percentile_sorted(ttft, 99),
    }
    if wl.tenants is not None:
        light = sorted(r[2] - r[1] for r in records if r[0] != "t0")
        out["light_ttft_p99_s"] = percentile_sorted(light, 99)
    for k in [k for k in out if k.endswith("_s") and k != "makespan_s"]:
        out[k[:-2] + "_frac"] = out[k] / makespan
    return out


CASES = [
    ("bursty_chat", bursty, ["fcfs", "sjf"], "ttft_p50_frac"),
    ("multi_tenant", tenants, ["fcfs", "fair"], "light_ttft_p99_frac"),
]


def main() -> int:
    """Run both workloads under both policies, real and simulated; compare the rankings."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "results" / "policy_study_torch.json"))
    args = ap.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="llmsched_policy_torch_") as tmp:
        model_dir = Path(tmp) / "small-llama"
        on_a_thread(build_model, model_dir, args.seed)
        ex = TorchExecutor(
            model_dir, dtype="bfloat16", seed=args.seed, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS
        )
        for name, make, policies, key in CASES:
            wl = make(args.seed, args.num_requests)
            out[name] = {}
            for policy in policies:
                spec = DeploymentSpec(
                    model=str(model_dir),
                    hardware="cpu",
                    block_size=ex.block_size,
                    num_gpu_blocks=ex.num_gpu_blocks,
                    max_model_len=ex.max_model_len,
                    max_num_batched_tokens=BUDGET,
                    max_num_seqs=SEQS,
                    scheduling_policy=policy,
                )
                dep = build_deployment(spec)
                real = figures(run_real(ex, dep.scheduler_config, wl, f"{name}-{policy}"), wl)
                sim = figures(simulate(dep, wl, record_requests=True).requests, wl)
                out[name][policy] = {"real": real, "sim": sim}
                print(
                    f"{name:13s} {policy:5s} real {key}={real[key]:.3f} (makespan {real['makespan_s']:.0f} s)"
                    f"  sim {key}={sim[key]:.3f} (makespan {sim['makespan_s']:.1f} s)",
                    flush=True,
                )
            a, b = policies
            better_real = out[name][b]["real"][key] < out[name][a]["real"][key]
            better_sim = out[name][b]["sim"][key] < out[name][a]["sim"][key]
            out[name]["ranking_agrees"] = better_real == better_sim
            print(f"{name}: {b} beats {a} on {key}: real {better_real}, sim {better_sim}")
        ex.close()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record_cpu(out), indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
