#!/usr/bin/env python3
"""What first-touch page faults in the KV cache cost the prefill steps that reach fresh blocks.

Builds the same engine twice (in-process, the serving thread count), once
as it comes (the CPU cache is lazily mapped memory) and once with the cache
written at startup (what `llmsched serve --prefault-kv-cache` does), and
runs the same bursts of --num-prompts prompts of --input-len random tokens,
one output token each (prefill only), --rounds times on each. Every round
lands on blocks the previous rounds never touched (the prefix cache hands
out fresh blocks before reusing freed ones), so the cold engine pays page
faults in every round. Reports prefill tokens/s per engine and their ratio.

    python benchmarks/serving/kv_prefault.py --model DIR [--json results/kv_prefault.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.core.sampling_params import SamplingParams  # noqa: E402
from llmsched.engine.llm import LLM  # noqa: E402


def burst(llm: LLM, n: int, length: int, seed: int) -> float:
    """Prefill tokens/s of one burst (one output token per prompt)."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(32, 127) for _ in range(length)]} for _ in range(n)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return n * length / (time.perf_counter() - t0)


def build(args: argparse.Namespace, prefault: bool) -> tuple[LLM, float]:
    """An engine as `serve` builds it (its batch defaults and threads), with or without the prefault."""
    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        usage_context="OPENAI_API_SERVER",
    )
    t0 = time.perf_counter()
    if prefault:
        llm.llm_engine.executor.prefault_kv_cache()
    # A warm-up burst outside the figures: the first forward's one-time costs.
    burst(llm, 1, 16, seed=999)
    return llm, time.perf_counter() - t0


def main() -> int:
    """Cold and prefaulted engines, the same bursts; figures and JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--json", type=Path, default=ROOT / "results/kv_prefault.json")
    args = p.parse_args()
    out: dict = {"config": {k: str(v) for k, v in vars(args).items()}}
    for name, prefault in (("cold", False), ("prefaulted", True)):
        llm, setup = build(args, prefault)
        rates = [burst(llm, args.num_prompts, args.input_len, seed=r) for r in range(args.rounds)]
        llm.close()
        out[name] = {"setup_s": setup, "prefill_tokens_per_s": rates, "median": statistics.median(rates)}
        print(
            f"{name:11} setup {setup:6.1f} s, prefill tok/s per round: "
            + ", ".join(f"{r:.0f}" for r in rates)
        )
    out["ratio"] = out["prefaulted"]["median"] / out["cold"]["median"]
    print(f"prefaulted / cold prefill tokens/s (medians): {out['ratio']:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record_cpu(out), indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
