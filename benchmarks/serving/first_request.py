#!/usr/bin/env python3
"""Time to first token of the first few requests after start-up, with and without the executor's warm-up.

Each run is a fresh process (first-time costs are per process): it builds
an ``LLM`` on --model (default: the embedded demo model), then makes
--calls consecutive ``generate`` calls of one request each (--prompt-len
random token ids, --max-tokens greedy tokens), and records each call's
TTFT and the start-up time. ``--warm-up off`` runs the same code with the
executor's start-up warm-up skipped, which is how the first request fared
before it existed. Runs alternate between the variants, --rounds times;
the median of each call's TTFT is reported per variant.

    python benchmarks/serving/first_request.py [--model DIR] [--dtype auto] [--rounds 3]
    python benchmarks/serving/first_request.py --num-threads 1 --json results/first_request.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu

ROOT = Path(__file__).resolve().parents[2]
_CHILD_FLAGS = ("model", "dtype", "num_threads", "max_model_len", "prompt_len", "max_tokens", "calls")


def child(args: argparse.Namespace) -> dict:
    """One process's start-up and calls (run with --child)."""
    sys.path.insert(0, str(ROOT / "src"))
    import random

    import llmsched.executor.torch.executor as executor_module
    from llmsched.core.sampling_params import SamplingParams
    from llmsched.engine.llm import LLM

    if args.warm_up == "off":
        executor_module.warm_up = lambda ex, n: None
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, max_model_len=args.max_model_len)
    load_s = time.perf_counter() - t0
    ex = llm.llm_engine.executor
    vocab = ex.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ttfts = []
    for _ in range(args.calls):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        ttfts.append(out.metrics.ttft * 1e3)
    warm = ex.warmup
    llm.close()
    return {
        "load_s": load_s,
        "warm_up_s": warm.seconds if warm is not None else None,
        "dtype": str(ex.dtype).removeprefix("torch."),
        "ttft_ms": ttfts,
    }


def cpu_model() -> str:
    """lscpu's model name."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    """Run the variants in alternation and print the medians."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the embedded demo model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--warm-up", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for variant in runs:
            cmd = [sys.executable, __file__, "--child", "--warm-up", variant]
            for flag in (
                "model",
                "dtype",
                "num_threads",
                "max_model_len",
                "prompt_len",
                "max_tokens",
                "calls",
            ):
                v = getattr(args, flag)
                if v is not None:
                    cmd += [f"--{flag.replace('_', '-')}", str(v)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    cpu = cpu_model()
    print(f"CPU: {cpu}; model: {args.model or 'embedded'}; dtype {runs['on'][0]['dtype']}")
    print(
        f"prompt {args.prompt_len} tokens, {args.calls} calls per process, median of {args.rounds} processes"
    )
    summary = {}
    for variant, rs in runs.items():
        med = [statistics.median(r["ttft_ms"][i] for r in rs) for i in range(args.calls)]
        load = statistics.median(r["load_s"] for r in rs)
        warm = [r["warm_up_s"] for r in rs if r["warm_up_s"] is not None]
        summary[variant] = {"ttft_ms_median": med, "load_s_median": load}
        extra = f", of which warm-up {statistics.median(warm):.2f} s" if warm else ""
        calls = "  ".join(f"{t:7.1f}" for t in med)
        print(f"warm-up {variant:3}: TTFT ms per call {calls}   start-up {load:.2f} s{extra}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"cpu": cpu, "args": {k: v for k, v in vars(args).items() if k != "json"}, "runs": runs}
        args.json.write_text(json.dumps(record_cpu({**payload, "summary": summary}), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
