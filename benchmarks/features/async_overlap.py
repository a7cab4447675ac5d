#!/usr/bin/env python3
"""Async scheduling against sync, same workload, same run: the torch executor and the simulator.

Torch executor: the e2e_cpu workload (64 prompts of 64-512 random tokens,
outputs of 64-512, greedy, EOS ignored) on e2e_cpu's small bfloat16 Llama,
given a word-level tokenizer so that every step's output is detokenized as
``LLM.generate`` does. The same LLMEngine runs it with async scheduling off
and on, alternating, ``--rounds`` times each. Reported per mode: output
throughput, TPOT (mean and median over requests), and the host gap: from
the end of one step's model work (its forward and sampling, all device
work on a GPU) to the start of the next forward (median and p99, over all
steps and over the steps that decode all 64 requests). With async
scheduling the engine schedules, prepares, detokenizes and applies outputs
while the executor's thread runs the model, so the gap is only the hand-off.

Simulator: llama-3-8b on h100, 1000 requests, 1024 input / 128 output
tokens, and a small model (qwen3-0.6b) on the same hardware, where the host
path is a larger share of a step (see benchmarks/features/async_overlap_sim.py).

    python benchmarks/features/async_overlap.py [--json results/async_overlap.json]
        [--skip-sim] [--skip-torch]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))

from hostcpu import record_cpu  # noqa: E402
from small_llama import SMALL, build_model, make_workload, on_a_thread  # noqa: E402

from llmsched.core import SamplingParams  # noqa: E402
from llmsched.engine.args import EngineArgs  # noqa: E402
from llmsched.engine.llm_engine import LLMEngine  # noqa: E402
from llmsched.engine.outputs import RequestOutputKind  # noqa: E402


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer over the model's whole vocabulary (token i is the word ``w{i}``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


class Timed:
    """Wraps the executor's model and sampler; records each step's (forward start, model work end, tokens).

    A step's model work is its forward and its sampling (on a GPU both are
    device work); the host gap is from its end to the next forward's start.
    """

    def __init__(self, model: object, sampler: object) -> None:
        self.model = model
        self.sampler = sampler
        self.calls: list[list[int]] = []

    def forward(self, input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        """The model's forward, timed."""
        t0 = time.perf_counter_ns()
        out = self.model.forward(input_ids, *args)
        self.calls.append([t0, time.perf_counter_ns(), int(input_ids.shape[0])])
        return out

    def sample(self, *args: object) -> object:
        """The sampler, its end counted as the step's."""
        out = self.sampler.sample(*args)
        self.calls[-1][1] = time.perf_counter_ns()
        return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


def gap_stats(calls: list[list[int]], batch: int) -> dict:
    """Host gaps between consecutive steps: all of them, and those before a decode of ``batch``."""
    pairs = list(itertools.pairwise(calls))
    gaps = [(b[0] - a[1]) / 1e6 for a, b in pairs]
    at_batch = [(b[0] - a[1]) / 1e6 for a, b in pairs if b[2] == batch]
    out = {"steps": len(calls)}
    for name, xs in (("all", gaps), (f"batch_{batch}", at_batch)):
        if xs:
            out[name] = {"n": len(xs), "median_ms": statistics.median(xs), "p99_ms": percentile(xs, 99)}
    return out


def run_once(engine: LLMEngine, wl: object, tag: str) -> dict:
    """The whole workload through ``engine``; throughput, TPOT and forward gaps."""
    ex = engine.executor
    timed = Timed(ex.model, ex.sampler)
    ex.model, ex.sampler = timed, timed
    try:
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            engine.add_request(
                f"{tag}-{i}", {"prompt_token_ids": p}, params, output_kind=RequestOutputKind.DELTA
            )
        finals = []
        while engine.has_unfinished_requests():
            finals.extend(o for o in engine.step() if o.finished)
        elapsed = time.perf_counter() - t0
    finally:
        ex.model, ex.sampler = timed.model, timed.sampler
    tpots = []
    for o in finals:
        m = o.metrics
        if m.num_generation_tokens > 1:
            tpots.append((m.last_token_time - m.first_token_time) / (m.num_generation_tokens - 1) * 1e3)
    produced = sum(o.metrics.num_generation_tokens for o in finals)
    assert produced == wl.useful_tokens, (produced, wl.useful_tokens)
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "output_tokens_per_s": produced / elapsed,
        "mean_tpot_ms": statistics.mean(tpots),
        "median_tpot_ms": statistics.median(tpots),
        "host_gap": gap_stats(timed.calls, len(wl.prompts)),
    }


def warm_up(engine: LLMEngine) -> None:
    """A few requests first: oneDNN builds its kernels and buffers grow on first use."""
    for i in range(8):
        engine.add_request(f"warm{i}", {"prompt_token_ids": list(range(300))}, SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()


def run_torch(num_prompts: int, seed: int, rounds: int) -> dict:
    """Both modes on the e2e_cpu workload, alternating, ``rounds`` runs each."""
    wl = make_workload(num_prompts, seed, SMALL["vocab_size"])
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="llmsched_async_") as tmp:
        model_dir = Path(tmp) / "small-llama"
        on_a_thread(build_model, model_dir, seed)
        write_tokenizer(model_dir, SMALL["vocab_size"])
        engines = {}
        for mode in ("sync", "async"):
            args = EngineArgs(
                model=str(model_dir),
                dtype="bfloat16",
                seed=seed,
                max_num_batched_tokens=8192,
                max_num_seqs=256,
                async_scheduling=mode == "async",
            )
            engines[mode] = LLMEngine(args)
            warm_up(engines[mode])
        try:
            for r in range(rounds):
                for mode in ("sync", "async"):
                    res = run_once(engines[mode], wl, f"{mode}{r}")
                    runs[mode].append(res)
                    g = res["host_gap"].get(f"batch_{num_prompts}", res["host_gap"].get("all", {}))
                    med, p99 = g.get("median_ms", math.nan), g.get("p99_ms", math.nan)
                    print(
                        f"  round {r + 1} {mode:5}: {res['output_tokens_per_s']:7.1f} output tok/s, "
                        f"TPOT mean {res['mean_tpot_ms']:.1f} ms, host gap at batch {num_prompts}: "
                        f"median {med:.3f} ms, p99 {p99:.3f} ms"
                    )
        finally:
            for e in engines.values():
                e.close()
    summary = {mode: _median_of_runs(rs) for mode, rs in runs.items()}
    return {
        "workload": {
            "num_prompts": num_prompts,
            "prompt_tokens": sum(len(p) for p in wl.prompts),
            "output_tokens": wl.useful_tokens,
            "seed": seed,
        },
        "model": {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", **SMALL},
        "runs": runs,
        "summary": summary,
        # Paired: each round runs both modes back to back, so a round's
        # ratio sees the same machine load; the median over rounds.
        "ratio_async_over_sync": {
            k: statistics.median(a[k] / s[k] for s, a in zip(runs["sync"], runs["async"]))
            for k in ("output_tokens_per_s", "mean_tpot_ms")
        },
        "round_ratios_output_tokens_per_s": [
            a["output_tokens_per_s"] / s["output_tokens_per_s"] for s, a in zip(runs["sync"], runs["async"])
        ],
    }


def _median_of_runs(runs: list[dict]) -> dict:
    """Each figure's median over the rounds."""
    out = {
        k: statistics.median(r[k] for r in runs)
        for k in ("output_tokens_per_s", "mean_tpot_ms", "median_tpot_ms", "elapsed_s")
    }
    for scope in runs[0]["host_gap"]:
        if scope == "steps":
            continue
        for stat in ("median_ms", "p99_ms"):
            out[f"host_gap_{scope}_{stat}"] = statistics.median(r["host_gap"][scope][stat] for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run both halves and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="runs per mode, alternating (torch executor)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable CPUs)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--json", default=str(ROOT / "results" / "async_overlap.json"))
    args = ap.parse_args(argv)
    result: dict = {"benchmark": "async_overlap"}
    if not args.skip_torch:
        threads = args.threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        print(f"torch executor, e2e_cpu workload, {threads} threads:")
        res = run_torch(args.num_prompts, args.seed, args.rounds)
        s, a = res["summary"]["sync"], res["summary"]["async"]
        key = f"host_gap_batch_{args.num_prompts}"
        for mode, x in (("sync", s), ("async", a)):
            print(
                f"  {mode:5} (median of rounds): {x['output_tokens_per_s']:7.1f} output tok/s, "
                f"TPOT mean {x['mean_tpot_ms']:.1f} ms / median {x['median_tpot_ms']:.1f} ms, host gap "
                f"at batch {args.num_prompts}: median {x.get(key + '_median_ms', float('nan')):.3f} ms, "
                f"p99 {x.get(key + '_p99_ms', float('nan')):.3f} ms; all steps: median "
                f"{x['host_gap_all_median_ms']:.3f} ms, p99 {x['host_gap_all_p99_ms']:.3f} ms"
            )
        r = res["ratio_async_over_sync"]
        rounds = ", ".join(f"{x:.3f}" for x in res["round_ratios_output_tokens_per_s"])
        print(
            f"  async / sync, median of the rounds' ratios: throughput {r['output_tokens_per_s']:.3f}x "
            f"(rounds: {rounds}), mean TPOT {r['mean_tpot_ms']:.3f}x"
        )
        result["torch"] = res | {"threads": threads, "torch_version": torch.__version__}
    if not args.skip_sim:
        from async_overlap_sim import DEFAULT_MODELS, format_comparison, run_sim_comparison

        result["sim"] = {}
        for model in DEFAULT_MODELS:
            cmp = run_sim_comparison(model=model)
            print(format_comparison(cmp))
            result["sim"][model] = cmp
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record_cpu(result), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
