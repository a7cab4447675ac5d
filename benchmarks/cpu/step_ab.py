#!/usr/bin/env python3
"""Torch executor step times against a baseline source tree, interleaved step by step in one process.

On a shared machine, whole runs one after the other see different loads;
so this runs both trees side by side. The baseline (``--base DIR``, a
``src`` folder holding the ``llmsched`` package, e.g. an older commit
unpacked with ``git archive REV src | tar -x -C /tmp/base``) is copied
under the package name ``llmsched_base`` and imported beside this tree.
Each tree gets its own TorchExecutor on ``--model`` (bfloat16, its own KV
cache) and EngineCore; both take the same ``--batch`` greedy requests of
``--prompt-len`` random tokens (or lengths drawn from
[``--min-prompt-len``, ``--prompt-len``]) and ``--output-len`` outputs and step in
lock-step (the same schedule, baseline step then this tree's), timing the
executor alone. The workload repeats ``--rounds`` times; each step's
figure is its fastest over the rounds. Reported: the prefill steps summed,
the median batch-``--batch`` decode step, and this tree's ratios to the
baseline (of those bests, and the median of each round's own ratio, which
a load that drifts between rounds moves less); and whether both produced
the same tokens.

``--threads`` sets each executor's torch threads (default 1: with two
executors in one process, two OpenMP teams would compete).

    python benchmarks/cpu/step_ab.py --model DIR --base /tmp/base/src --json results/step_ab.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402


def import_renamed(src: Path, tmp: Path, name: str) -> object:
    """The ``llmsched`` package under ``src``, copied and imported as ``name``."""
    dst = tmp / name
    shutil.copytree(src / "llmsched", dst, ignore=shutil.ignore_patterns("__pycache__"))
    pattern = re.compile(r"\bllmsched\b")
    for path in dst.rglob("*.py"):
        path.write_text(pattern.sub(name, path.read_text()))
    sys.path.insert(0, str(tmp))
    return importlib.import_module(name)


def run_round(pkgs: dict, executors: dict, args: argparse.Namespace, rnd: int) -> dict:
    """One pass of the workload through both trees in lock-step: per-tree step times and tokens."""
    engines = {}
    requests = {}
    for label, pkg in pkgs.items():
        core, engine_mod = pkg["core"], pkg["engine"]
        ex = executors[label]
        config = core.SchedulerConfig(
            block_size=ex.block_size,
            num_gpu_blocks=ex.num_gpu_blocks,
            max_model_len=ex.max_model_len,
            max_num_batched_tokens=8192,
            max_num_seqs=256,
        )
        rng = random.Random(args.seed + rnd)
        vocab = ex.model.config.vocab_size
        params = core.SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        reqs = [
            core.Request(f"r{rnd}-{i}", [rng.randrange(vocab) for _ in range(n)], params)
            for i, n in enumerate(prompt_lens(args, rng))
        ]
        engines[label] = engine_mod.EngineCore(config, ex)
        for r in reqs:
            engines[label].add_request(r)
        requests[label] = reqs
    times: dict[str, list[tuple[str, float]]] = {label: [] for label in pkgs}
    first = next(iter(engines.values()))
    while first.has_requests():
        for label, engine in engines.items():
            s = engine.step()
            so = s.scheduler_output
            kind = "decode" if so.total_num_scheduled_tokens == len(so.scheduled) == args.batch else "other"
            if so.total_num_scheduled_tokens > len(so.scheduled):
                kind = "prefill"
            times[label].append((kind, s.execute_ns / 1e6))
    tokens = {label: [r.output_token_ids for r in reqs] for label, reqs in requests.items()}
    return {"times": times, "tokens": tokens}


def prompt_lens(args: argparse.Namespace, rng: random.Random) -> list[int]:
    """``--batch`` prompt lengths: ``--prompt-len``, or drawn from [``--min-prompt-len``, that]."""
    if args.min_prompt_len is None:
        return [args.prompt_len] * args.batch
    return [rng.randint(args.min_prompt_len, args.prompt_len) for _ in range(args.batch)]


def summarize(rounds: list[dict], label: str) -> dict:
    """Each step's fastest time over the rounds; prefill summed, decode median."""
    steps = list(zip(*(r["times"][label] for r in rounds)))
    best = [(s[0][0], min(t for _, t in s)) for s in steps]
    prefill = [t for k, t in best if k == "prefill"]
    decode = [t for k, t in best if k == "decode"]
    return {
        "prefill_s": sum(prefill) / 1e3,
        "prefill_steps": len(prefill),
        "decode_ms": statistics.median(decode),
        "decode_steps": len(decode),
    }


def round_ratios(rounds: list[dict]) -> dict[str, list[float]]:
    """Each round's new / base ratios (prefill sum, decode median), one per round."""
    out: dict[str, list[float]] = {"prefill": [], "decode": []}
    for r in rounds:
        b, n = summarize([r], "base"), summarize([r], "new")
        out["prefill"].append(n["prefill_s"] / b["prefill_s"])
        out["decode"].append(n["decode_ms"] / b["decode_ms"])
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--base", type=Path, required=True, help="the baseline's src folder")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument(
        "--min-prompt-len",
        type=int,
        default=None,
        help="draw each prompt's length from [this, --prompt-len] (mixed contexts; default: all equal)",
    )
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--threads", type=int, default=1, help="torch threads per executor (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = import_renamed(args.base.resolve(), Path(tmp), "llmsched_base")
        import llmsched

        pkgs, executors = {}, {}
        for label, pkg in (("base", base), ("new", llmsched)):
            name = pkg.__name__
            pkgs[label] = {
                "core": importlib.import_module(f"{name}.core"),
                "engine": importlib.import_module(f"{name}.engine"),
            }
            torch_ex = importlib.import_module(f"{name}.executor.torch")
            executors[label] = torch_ex.TorchExecutor(
                args.model,
                dtype="bfloat16",
                seed=args.seed,
                max_num_batched_tokens=8192,
                max_num_seqs=256,
                num_threads=args.threads,
                num_gpu_blocks=args.batch * (-(-(args.prompt_len + args.output_len) // 128) + 1) + 64,
            )
        # Warm-up: oneDNN kernels built, buffers grown.
        warm = argparse.Namespace(
            **{**vars(args), "batch": 8, "prompt_len": 300, "min_prompt_len": None, "output_len": 4}
        )
        run_round(pkgs, executors, warm, -1)
        rounds = []
        for rnd in range(args.rounds):
            r = run_round(pkgs, executors, args, rnd)
            rounds.append(r)
            figs = {label: summarize([r], label) for label in pkgs}
            print(
                f"round {rnd}: "
                + ", ".join(
                    f"{label} prefill {f['prefill_s']:.3f} s decode {f['decode_ms']:.2f} ms"
                    for label, f in figs.items()
                ),
                flush=True,
            )
        for ex in executors.values():
            ex.close()
    same = all(r["tokens"]["base"] == r["tokens"]["new"] for r in rounds)
    figs = {label: summarize(rounds, label) for label in pkgs}
    b, n = figs["base"], figs["new"]
    ratios = {"prefill": n["prefill_s"] / b["prefill_s"], "decode": n["decode_ms"] / b["decode_ms"]}
    per_round = round_ratios(rounds)
    print(f"greedy tokens identical: {same}")
    for label, f in figs.items():
        print(
            f"{label:>5}: prefill {f['prefill_s']:.3f} s ({f['prefill_steps']} steps), "
            f"decode {f['decode_ms']:.2f} ms/step ({f['decode_steps']} steps at batch {args.batch})"
        )
    print(f"new / base: prefill x{ratios['prefill']:.3f}, decode x{ratios['decode']:.3f}")
    print(
        "new / base, median of the rounds' own ratios: "
        f"prefill x{statistics.median(per_round['prefill']):.3f}, "
        f"decode x{statistics.median(per_round['decode']):.3f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "figures": figs,
            "ratios": ratios,
            "round_ratios": per_round,
        }
        args.json.write_text(json.dumps(record_cpu({**out, "tokens_identical": same}), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
