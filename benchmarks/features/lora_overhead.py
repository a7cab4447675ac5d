#!/usr/bin/env python3
"""Multi-LoRA overhead: batch 64 mixing four rank-16 adapters vs the base model alone, same run.

Model: e2e_cpu's ``small`` random-weight Llama (hidden 512, 8 layers,
intermediate 1536, vocab 32000, bfloat16). Adapters: four random PEFT
folders of rank 16 on all seven projections (q/k/v/o/gate/up/down), alpha
32. Workload: 64 prompts with prompt and output lengths drawn from
``--min-len``..``--max-len`` (seed 0), greedy, EOS ignored, the whole batch
queued before the first step, through EngineCore and one TorchExecutor
(``enable_lora``, ``max_loras=4``) with async scheduling. The LoRA arm gives
request i adapter i % 4, so every step mixes all four; the base arm runs
the same requests with no adapter (the executor's plain path).

Figures: output tokens/s of each arm and their ratio (rounds in ABBA order,
ratio of the summed times).

    python benchmarks/features/lora_overhead.py [--json results/lora_overhead.json] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from llmsched import LoRARequest  # noqa: E402
from llmsched.core import Request, SamplingParams, SchedulerConfig  # noqa: E402
from llmsched.engine import EngineCore  # noqa: E402
from llmsched.executor.torch import TorchExecutor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402
from small_llama import SMALL, on_a_thread  # noqa: E402
from small_llama import build_model as build_small  # noqa: E402

NUM_ADAPTERS = 4
RANK = 16
BATCH = 64


def write_adapter(folder: Path, seed: int) -> None:
    """A random PEFT LoRA folder for the small Llama (every projection, rank 16)."""
    h, inter = SMALL["hidden_size"], SMALL["intermediate_size"]
    d = h // SMALL["num_attention_heads"]
    kv = SMALL["num_key_value_heads"] * d
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(SMALL["num_hidden_layers"]):
        for mod, (fin, fout) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{mod}"
            tensors[f"{key}.lora_A.weight"] = 0.02 * torch.randn(RANK, fin, generator=g)
            tensors[f"{key}.lora_B.weight"] = 0.02 * torch.randn(fout, RANK, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "target_modules": [m.split(".")[1] for m in shapes],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))


def make_workload(n: int, seed: int, lo: int, hi: int) -> tuple[list[list[int]], list[int]]:
    """Seeded prompt and output lengths in [lo, hi], random token ids."""
    rng = random.Random(seed)
    lens = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]
    return [[rng.randrange(17, SMALL["vocab_size"]) for _ in range(p)] for p, _ in lens], [o for _, o in lens]


def run_once(config: SchedulerConfig, ex: TorchExecutor, prompts: list, outs: list, loras: list) -> dict:
    """The workload through a fresh EngineCore; wall time and tokens."""
    reqs = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        lr = loras[i % len(loras)] if loras else None
        reqs.append(
            Request(
                f"{'l' if loras else 'b'}{i}",
                p,
                SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True),
                lora_id=lr.lora_int_id if lr else 0,
                lora_name=lr.lora_name if lr else None,
            )
        )
    engine = EngineCore(config, ex)
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    steps = 0
    while engine.has_requests():
        steps += engine.step() is not None
    elapsed = time.perf_counter() - t0
    produced = sum(r.num_output_tokens for r in reqs)
    assert produced == sum(outs), (produced, sum(outs))
    return {"elapsed_s": elapsed, "tokens": produced, "tokens_per_s": produced / elapsed, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(ROOT / "results" / "lora_overhead.json"))
    ap.add_argument("--rounds", type=int, default=1, help="ABBA rounds (each runs both arms twice)")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: executor's)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "llmsched" / "bench-lora-small"))
    args = ap.parse_args(argv)
    folder = Path(args.cache_dir)
    model = folder / "model"
    if not (model / "config.json").is_file():
        model.mkdir(parents=True, exist_ok=True)
        on_a_thread(build_small, model, 0)
    loras = []
    for k in range(1, NUM_ADAPTERS + 1):
        path = folder / f"adapter{k}"
        if not (path / "adapter_config.json").is_file():
            write_adapter(path, k)
        loras.append(LoRARequest(f"adapter{k}", k, str(path)))

    ex = TorchExecutor(
        model,
        dtype="bfloat16",
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        num_threads=args.num_threads,
        enable_lora=True,
        max_loras=NUM_ADAPTERS,
        max_lora_rank=RANK,
    )
    for lr in loras:
        ex.add_lora(lr)
    config = SchedulerConfig(
        block_size=ex.block_size,
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_loras=NUM_ADAPTERS,
        async_scheduling=True,
    )
    prompts, outs = make_workload(BATCH, 0, args.min_len, args.max_len)
    # Warm-up, both arms: oneDNN kernels, buffers, the adapters' slots.
    run_once(config, ex, prompts[:8], [8] * 8, [])
    run_once(config, ex, prompts[:8], [8] * 8, loras)
    runs: dict[str, list[dict]] = {"b": [], "l": []}
    round_ratios: list[float] = []
    for k in range(args.rounds):
        order = ("b", "l", "l", "b") if k % 2 == 0 else ("l", "b", "b", "l")
        for arm in order:
            res = run_once(config, ex, prompts, outs, loras if arm == "l" else [])
            runs[arm].append(res)
            name = "4 adapters" if arm == "l" else "base      "
            print(f"round {k} {name}: {res['tokens_per_s']:.1f} tok/s ({res['elapsed_s']:.1f} s)")
        b, lo = runs["b"][-2:], runs["l"][-2:]
        round_ratios.append(sum(r["elapsed_s"] for r in b) / sum(r["elapsed_s"] for r in lo))
    ex.close()
    b_time = sum(r["elapsed_s"] for r in runs["b"])
    l_time = sum(r["elapsed_s"] for r in runs["l"])
    tokens = sum(r["tokens"] for r in runs["b"])
    ratio = b_time / l_time
    result = {
        "workload": (
            f"{BATCH} prompts, prompt and output lengths in [{args.min_len}, {args.max_len}], greedy, "
            "ignore_eos, async scheduling; e2e_cpu's small Llama in bfloat16"
        ),
        "adapters": {"count": NUM_ADAPTERS, "rank": RANK, "targets": "q,k,v,o,gate,up,down"},
        "rounds": args.rounds,
        "base_tokens_per_s": tokens / b_time,
        "lora_tokens_per_s": tokens / l_time,
        "throughput_ratio": ratio,
        "round_ratios": round_ratios,
        "target": 0.75,
        "torch_threads": torch.get_num_threads(),
        "note": "shared 2-core machine; both arms in the same run, ABBA order",
    }
    print(
        f"base {result['base_tokens_per_s']:.1f} tok/s, four rank-{RANK} adapters "
        f"{result['lora_tokens_per_s']:.1f} tok/s: ratio {ratio:.3f}x (target >= 0.75x)"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record_cpu(result), indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
