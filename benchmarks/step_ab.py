#!/usr/bin/env python3
"""Torch executor step times, one source tree against another, alternated in the same run.

Each round starts one child process per source tree (``--src LABEL=DIR``,
DIR holding the ``llmsched`` package, e.g. an older commit unpacked with
``git archive REV src | tar -x -C /tmp/base``), in the order given, then
the next round in the same order, so both trees see the same machine load
over time. A child loads ``--model`` with TorchExecutor (bfloat16),
warms up, queues ``--batch`` greedy requests of ``--prompt-len`` random
tokens and ``--output-len`` outputs and steps them to completion through
EngineCore, timing the executor alone: the summed prefill steps (the
prompts, chunked to the 8192-token step budget) and each batch-``--batch``
decode step. The workload is the same every round, so a tree's figures
take each step's fastest time over the rounds, then sum the prefill steps
and take the decode steps' median; ratios are against the first tree.
``--threads 1`` keeps the OpenMP stalls of a shared machine (a parallel
region waits for its descheduled thread) out of the comparison.

    python benchmarks/step_ab.py --model DIR --src base=/tmp/base/src --src new=src
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> dict:
    """One tree's measurement (runs in the child process, with that tree first on sys.path)."""
    import threading

    import torch

    from llmsched.core import Request, SamplingParams, SchedulerConfig
    from llmsched.engine import EngineCore
    from llmsched.executor.torch import TorchExecutor

    torch.manual_seed(0)
    ex = TorchExecutor(
        args.model,
        dtype="bfloat16",
        seed=0,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        num_threads=args.threads,
    )
    config = SchedulerConfig(
        block_size=ex.block_size,
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
    )
    vocab = ex.model.config.vocab_size
    rng = random.Random(args.seed)

    def run(n: int, plen: int, olen: int, tag: str) -> tuple[list[float], list[float], list[list[int]]]:
        engine = EngineCore(config, ex)
        params = SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True)
        reqs = [Request(f"{tag}{i}", [rng.randrange(vocab) for _ in range(plen)], params) for i in range(n)]
        for r in reqs:
            engine.add_request(r)
        prefill, decode = [], []
        while engine.has_requests():
            s = engine.step()
            so = s.scheduler_output
            ms = s.execute_ns / 1e6
            if so.total_num_scheduled_tokens == len(so.scheduled) == n:
                decode.append(ms)
            elif so.total_num_scheduled_tokens > len(so.scheduled):
                prefill.append(ms)
        return prefill, decode, [r.output_token_ids for r in reqs]

    box: list[dict] = []

    def body() -> None:
        run(8, 300, 4, "w")  # oneDNN kernels built, buffers grown
        prefill, decode, tokens = run(args.batch, args.prompt_len, args.output_len, "r")
        box.append(
            {"prefill_ms": prefill, "decode_ms": decode, "tokens_hash": hash(tuple(map(tuple, tokens)))}
        )

    # The executor runs its steps on a thread of its own; so does this (see e2e_cpu.on_a_thread).
    t = threading.Thread(target=body)
    t.start()
    t.join()
    ex.close()
    return box[0]


def best_of_rounds(rounds: list[dict]) -> dict:
    """Each step's fastest time over the rounds (the same steps every round), then summed / the median."""
    prefill = [min(steps) for steps in zip(*(r["prefill_ms"] for r in rounds))]
    decode = [min(steps) for steps in zip(*(r["decode_ms"] for r in rounds))]
    return {"prefill_s": sum(prefill) / 1e3, "decode_ms": statistics.median(decode)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument(
        "--src", action="append", required=True, metavar="LABEL=DIR", help="source trees, baseline first"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the executor's)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    trees = [s.split("=", 1) for s in args.src]
    runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
    passthrough = list(argv if argv is not None else sys.argv[1:])
    for rnd in range(args.rounds):
        for label, src in trees:
            env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), PYTHONHASHSEED="0")
            t = time.perf_counter()
            out = subprocess.run(
                [sys.executable, __file__, *passthrough, "--child"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            runs[label].append(r)
            print(
                f"round {rnd} {label:>8}: prefill {sum(r['prefill_ms']) / 1e3:.3f} s "
                f"({len(r['prefill_ms'])} steps), decode median "
                f"{statistics.median(r['decode_ms']):.2f} ms/step "
                f"({len(r['decode_ms'])} steps) [{time.perf_counter() - t:.0f} s]",
                flush=True,
            )
    base = trees[0][0]
    best = {label: best_of_rounds(rs) for label, rs in runs.items()}
    same = len({r["tokens_hash"] for rs in runs.values() for r in rs}) == 1
    print(f"greedy tokens identical across trees: {same}")
    for label, b in best.items():
        print(
            f"{label:>8}: prefill {b['prefill_s']:.3f} s (x{b['prefill_s'] / best[base]['prefill_s']:.3f}), "
            f"decode {b['decode_ms']:.2f} ms (x{b['decode_ms'] / best[base]['decode_ms']:.3f}) vs {base}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "best": best,
                    "runs": runs,
                    "tokens_identical": same,
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
