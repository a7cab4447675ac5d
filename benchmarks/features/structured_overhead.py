#!/usr/bin/env python3
"""Structured-output overhead: the e2e_cpu workload at batch 64, JSON-schema constrained vs not, same run.

Model and workload are e2e_cpu's ``small`` case: a random-weight Llama
(hidden 512, 8 layers, vocab 32000, bfloat16) and 64 prompts with prompt
and output lengths drawn from [64, 512] (seed 0), greedy, EOS ignored, the
whole batch queued before the first step, through EngineCore and the
TorchExecutor with the engine's default (async) scheduling. The model has
no tokenizer of its own; the grammar's vocabulary is SmolLM2's byte-level
BPE cut to the model's 32000 ids (a real vocabulary: token masks cost what
they cost on a real model of that size).

Every constrained request gets the same nested JSON schema. With EOS
ignored, a request whose grammar completes goes on unconstrained to its
length, so both runs produce the same tokens per request; the share of
tokens produced under the grammar is reported with the figures.

Figures: output tokens/s of each run, their ratio (rounds in ABBA order,
ratio of the summed times), and the grammar's cost per constrained step,
timed inside the executor: filling and applying the token bitmask before
sampling, and advancing the matchers after it.

    python benchmarks/features/structured_overhead.py [--json results/structured_overhead.json] [--rounds 2]
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

from llmsched.core import Request, SamplingParams, SchedulerConfig, StructuredOutputsParams  # noqa: E402
from llmsched.engine import EngineCore  # noqa: E402
from llmsched.engine.tokenizer import load_tokenizer  # noqa: E402
from llmsched.executor.torch import TorchExecutor  # noqa: E402
from llmsched.structured.manager import StructuredOutputManager  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402
from small_llama import SMALL, on_a_thread  # noqa: E402
from small_llama import build_model as build_small  # noqa: E402

VOCAB = SMALL["vocab_size"]
EOS = 2  # <|im_end|> in SmolLM2's vocabulary, and LlamaConfig's default eos_token_id
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
    },
    "required": ["id", "name", "email", "role", "score", "active", "tags", "address"],
}


def make_workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """e2e_cpu's: prompt and output lengths in [64, 512], random ids (token 0-16 are special: avoided)."""
    rng = random.Random(seed)
    lens = [(rng.randint(64, 512), rng.randint(64, 512)) for _ in range(n)]
    return [[rng.randrange(17, VOCAB) for _ in range(p)] for p, _ in lens], [o for _, o in lens]


def build_model(folder: Path) -> None:
    """The small Llama with transformers' seeded random initialisation, plus a 32000-token tokenizer."""
    if not (folder / "config.json").is_file():
        build_small(folder, 0)
    if not (folder / "tokenizer.json").is_file():
        write_cut_tokenizer(folder)


def write_cut_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer.json keeping ids below 32000 (and the merges that make them)."""
    from llmsched.engine.chat_model import ensure_chat_model
    from llmsched.executor.torch.gguf import model_folder

    source = json.loads((model_folder(ensure_chat_model()) / "tokenizer.json").read_text())
    model = source["model"]
    vocab = {t: i for t, i in model["vocab"].items() if i < VOCAB}
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    model["vocab"], model["merges"] = vocab, merges
    source["added_tokens"] = [t for t in source["added_tokens"] if t["id"] < VOCAB]
    (folder / "tokenizer.json").write_text(json.dumps(source))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


class GrammarTimer:
    """Wraps the executor's two grammar methods to time them, per step."""

    def __init__(self, ex: TorchExecutor) -> None:
        self.mask_s: list[float] = []
        self.advance_s: list[float] = []
        apply, advance = ex._apply_grammars, ex._advance_grammars

        def timed_apply(logits: object, states: list) -> None:
            t = time.perf_counter()
            apply(logits, states)
            self.mask_s.append(time.perf_counter() - t)

        def timed_advance(states: list, tokens: list[int]) -> None:
            t = time.perf_counter()
            advance(states, tokens)
            self.advance_s.append(time.perf_counter() - t)

        ex._apply_grammars = timed_apply  # type: ignore[method-assign]
        ex._advance_grammars = timed_advance  # type: ignore[method-assign]

    def reset(self) -> None:
        self.mask_s.clear()
        self.advance_s.clear()


def run_once(config: SchedulerConfig, ex: TorchExecutor, prompts: list, outs: list, grammar: object) -> dict:
    """The workload through a fresh EngineCore; wall time, steps, and the requests."""
    so = StructuredOutputsParams(json=SCHEMA) if grammar is not None else None
    reqs = [
        Request(
            f"{'c' if grammar else 'u'}{i}",
            p,
            SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True, structured_outputs=so),
            eos_token_ids=[EOS],
            grammar=grammar,
        )
        for i, (p, o) in enumerate(zip(prompts, outs))
    ]
    engine = EngineCore(config, ex)
    step_ms: list[float] = []
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    while engine.has_requests():
        s = engine.step()
        if s is not None and s.scheduler_output.scheduled:
            step_ms.append((s.schedule_ns + s.execute_ns + s.update_ns) / 1e6)
    elapsed = time.perf_counter() - t0
    produced = sum(r.num_output_tokens for r in reqs)
    assert produced == sum(outs), (produced, sum(outs))
    return {"elapsed_s": elapsed, "tokens": produced, "tokens_per_s": produced / elapsed, "reqs": reqs}


def grammar_share(reqs: list[Request], grammar: object, tokenizer: object) -> dict:
    """Tokens produced while each grammar was active, and whether each completed text validates."""
    import jsonschema

    from llmsched.structured.matcher import new_matcher

    constrained = completed = valid = 0
    for r in reqs:
        m = new_matcher(grammar, [])
        out = r.output_token_ids
        n = 0
        for t in out:
            if m.is_terminated() or not m.accept_token(t):
                break
            n += 1
        constrained += n
        if m.is_terminated():
            completed += 1
            try:
                jsonschema.validate(json.loads(tokenizer.decode(out[: n - 1])), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    total = sum(r.num_output_tokens for r in reqs)
    return {
        "constrained_tokens": constrained,
        "constrained_share": constrained / total,
        "grammars_completed": completed,
        "completed_and_valid": valid,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(ROOT / "results" / "structured_overhead.json"))
    ap.add_argument("--rounds", type=int, default=1, help="ABBA rounds (each runs both arms twice)")
    ap.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: executor's)")
    ap.add_argument(
        "--cache-dir", default=str(Path.home() / ".cache" / "llmsched" / "bench-structured-small")
    )
    args = ap.parse_args(argv)
    folder = Path(args.cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    on_a_thread(build_model, folder)
    tokenizer = load_tokenizer(folder)
    manager = StructuredOutputManager(tokenizer, VOCAB, [EOS])
    t = time.perf_counter()
    grammar = manager.grammar_for(StructuredOutputsParams(json=SCHEMA))
    grammar.future.result()
    compile_s = time.perf_counter() - t

    ex = TorchExecutor(
        folder, dtype="bfloat16", max_num_batched_tokens=8192, max_num_seqs=256, num_threads=args.num_threads
    )
    config = SchedulerConfig(
        block_size=ex.block_size,
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        async_scheduling=True,
    )
    timer = GrammarTimer(ex)
    prompts, outs = make_workload(64, 0)
    # Warm-up, both arms: oneDNN kernels, buffers, the bitmask.
    run_once(config, ex, prompts[:8], [8] * 8, None)
    run_once(config, ex, prompts[:8], [8] * 8, grammar)
    timer.reset()
    plain: list[dict] = []
    constrained: list[dict] = []
    round_ratios: list[float] = []
    for k in range(args.rounds):
        order = ("u", "c", "c", "u") if k % 2 == 0 else ("c", "u", "u", "c")
        times = {"u": 0.0, "c": 0.0}
        for arm in order:
            res = run_once(config, ex, prompts, outs, grammar if arm == "c" else None)
            (constrained if arm == "c" else plain).append(res)
            times[arm] += res["elapsed_s"]
            name = "constrained  " if arm == "c" else "unconstrained"
            print(f"round {k} {name}: {res['tokens_per_s']:.1f} tok/s")
        round_ratios.append(times["u"] / times["c"])
    ex.close()
    manager.close()

    u_time = sum(r["elapsed_s"] for r in plain)
    c_time = sum(r["elapsed_s"] for r in constrained)
    ratio = u_time / c_time
    share = grammar_share(constrained[-1]["reqs"], grammar, tokenizer)
    steps = len(timer.mask_s)
    mask_ms = 1e3 * statistics.mean(timer.mask_s) if steps else 0.0
    adv_ms = 1e3 * statistics.mean(timer.advance_s) if timer.advance_s else 0.0
    per_run_c = statistics.mean(r["tokens_per_s"] for r in constrained)
    per_run_u = statistics.mean(r["tokens_per_s"] for r in plain)
    c_step_ms = 1e3 * c_time / steps if steps else 0.0
    result = {
        "workload": "e2e_cpu small: 64 prompts, lengths in [64, 512], greedy, ignore_eos, async scheduling",
        "schema": SCHEMA,
        "grammar_compile_s": compile_s,
        "unconstrained_tokens_per_s": per_run_u,
        "constrained_tokens_per_s": per_run_c,
        "throughput_ratio": ratio,
        "round_ratios": round_ratios,
        "median_round_ratio": statistics.median(round_ratios),
        "runs_per_arm": len(plain),
        "constrained_steps_timed": steps,
        "mask_ms_per_step": mask_ms,
        "advance_ms_per_step": adv_ms,
        "grammar_ms_per_step": mask_ms + adv_ms,
        "grammar_share_of_constrained_wall": (mask_ms + adv_ms) / c_step_ms if c_step_ms else 0.0,
        **share,
    }
    print()
    print(f"grammar compile (32000-token vocabulary): {compile_s * 1e3:.0f} ms")
    print(f"unconstrained: {per_run_u:.1f} output tok/s (mean of {len(plain)} runs)")
    print(f"constrained:   {per_run_c:.1f} output tok/s (mean of {len(constrained)} runs)")
    print(
        f"constrained / unconstrained throughput: {ratio:.3f}x (summed times); per ABBA round: "
        + ", ".join(f"{r:.3f}" for r in round_ratios)
        + f" (median {statistics.median(round_ratios):.3f})"
    )
    print(
        f"grammar per constrained step: mask {mask_ms:.2f} ms + advance {adv_ms:.2f} ms "
        f"over {steps} steps ({100 * result['grammar_share_of_constrained_wall']:.1f}% of the wall time)"
    )
    print(
        f"tokens under the grammar: {100 * share['constrained_share']:.1f}%; grammars completed: "
        f"{share['grammars_completed']}/64, their JSON valid: {share['completed_and_valid']}"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record_cpu(result), indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
