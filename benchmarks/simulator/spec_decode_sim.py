#!/usr/bin/env python3
"""Where speculative decoding pays, in the simulator: acceptance rate x K x batch against spec off.

One model on one hardware profile (default llama-3-8b on an H100, drafts
from llama-3.2-1b priced on the same GPU, or ``--method ngram``), a
closed-loop client with ``batch`` requests in flight (``--num-prompts``
of 512 prompt / 256 output tokens). For every batch size the run without
speculation is the baseline; each (acceptance rate, K) point reports its
output tok/s over that baseline's. Acceptance rates are per draft token,
given every earlier draft was accepted (see executor/sim/spec_decode.py).

    python benchmarks/simulator/spec_decode_sim.py [--model llama-3-8b] [--hardware h100]
        [--method draft_model] [--rates 0,0.3,0.5,0.7,0.9] [--ks 1,2,4] [--batches 1,8,64]
        [--json results/spec_decode_sim.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.sim import DeploymentSpec, build_deployment, simulate, synthetic_workload  # noqa: E402


def throughput(args: argparse.Namespace, batch: int, spec: dict | None) -> dict:
    """Output tok/s, mean TPOT and acceptance figures of one point."""
    dep = build_deployment(
        DeploymentSpec(
            model=args.model,
            hardware=args.hardware,
            speculative_config=spec,
            async_scheduling=True,
        )
    )
    n = max(args.num_prompts, 4 * batch)
    res = simulate(dep, synthetic_workload(n, args.input_len, args.output_len, seed=0), max_concurrency=batch)
    sd = res.spec_decode or {}
    return {
        "output_throughput": res.summary["output_throughput"],
        "mean_tpot_ms": res.summary["mean_tpot_ms"],
        "acceptance_rate": sd.get("acceptance_rate"),
        "mean_acceptance_length": sd.get("mean_acceptance_length"),
    }


def spec_config(args: argparse.Namespace, k: int, rate: float) -> dict:
    """The speculative config of one point."""
    base: dict = {"num_speculative_tokens": k, "acceptance_rate": rate, "seed": 0}
    if args.method == "ngram":
        return {"method": "ngram", **base}
    return {"model": args.draft_model, **base}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--method", choices=["draft_model", "ngram"], default="draft_model")
    p.add_argument("--draft-model", default="llama-3.2-1b")
    p.add_argument("--rates", default="0,0.3,0.5,0.7,0.9")
    p.add_argument("--ks", default="1,2,4")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    drafter = args.draft_model if args.method == "draft_model" else "n-gram lookup"
    print(f"{args.model} on {args.hardware}, drafts from {drafter}; tok/s with / without speculation")
    rows = []
    for batch in batches:
        off = throughput(args, batch, None)
        print(f"\nbatch {batch}: spec off {off['output_throughput']:.0f} tok/s")
        print("rate  " + "".join(f"   K={k:<4}" for k in ks))
        for rate in rates:
            line = f"{rate:<5g} "
            for k in ks:
                on = throughput(args, batch, spec_config(args, k, rate))
                ratio = on["output_throughput"] / off["output_throughput"]
                rows.append({"batch": batch, "k": k, "rate": rate, "ratio": ratio, "off": off, "on": on})
                line += f"   {ratio:5.2f}x"
            print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        keys = ("model", "hardware", "method", "draft_model", "input_len", "output_len")
        meta = {k: getattr(args, k) for k in keys}
        Path(args.json).write_text(json.dumps(record_cpu({"config": meta, "points": rows}), indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
