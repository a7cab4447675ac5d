#!/usr/bin/env python3
"""Where a torch-executor prefill step spends its time, by kind of op (torch.profiler).

Loads --model (bfloat16) in a TorchExecutor on --threads torch threads,
warms it up, then profiles the model forward of one step that prefills
--batch random prompts of --prompt-len tokens (8 x 256 = 2,048 tokens by
default). Each op's self time goes into one bucket: the linears (oneDNN
matmuls, the LM head included), flash attention, the KV cache writes, the
elementwise ops (RMSNorm, RoPE, SwiGLU, residual adds, dtype conversions)
and the rest (views, allocation, indexing). On a shared machine the shares
are the figure to read; the times move with the load. Prints the buckets
and the top ops, writes JSON.

    python benchmarks/cpu/prefill_profile.py --model DIR --json results/prefill_profile.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched import core  # noqa: E402
from llmsched.engine import EngineCore  # noqa: E402
from llmsched.executor.torch import TorchExecutor  # noqa: E402
from llmsched.executor.torch.model import DecoderModel  # noqa: E402

LINEAR = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear")
ATTENTION = ("scaled_dot_product", "flash_attention", "prefill_attention", "aten::bmm", "aten::_softmax")
CACHE_WRITES = ("aten::_index_put_impl_", "aten::index_copy_")
ELEMENTWISE = (
    "llmsched::swiglu",
    "aten::silu",
    "aten::mul",
    "aten::add",
    "aten::sub",
    "aten::div",
    "aten::pow",
    "aten::rsqrt",
    "aten::sum",
    "aten::mean",
    "aten::copy_",
    "aten::neg",
    "aten::cat",
    "aten::fill_",
)


def bucket(name: str) -> str:
    """The bucket an op's self time goes to."""
    for label, names in (
        ("linears", LINEAR),
        ("attention", ATTENTION),
        ("cache writes", CACHE_WRITES),
        ("elementwise", ELEMENTWISE),
    ):
        if any(name.startswith(n) or (label == "attention" and n in name) for n in names):
            return label
    return "other"


def prefill_step(ex: TorchExecutor, batch: int, prompt_len: int, seed: int) -> float:
    """Run ``batch`` fresh prompts to their first token; the prefill step's executor ms."""
    config = core.SchedulerConfig(
        block_size=ex.block_size,
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        max_num_batched_tokens=max(8192, batch * prompt_len),
        max_num_seqs=max(256, batch),
    )
    engine = EngineCore(config, ex)
    rng = random.Random(seed)
    params = core.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = ex.model.config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        engine.add_request(core.Request(f"p{seed}-{i}", prompt, params))
    step = engine.step()
    while engine.has_requests():
        engine.step()
    return step.execute_ns / 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2, help="unprofiled prefill steps first")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    blocks = args.batch * (-(-(args.prompt_len + 1) // 128) + 1) + 80
    ex = TorchExecutor(args.model, dtype="bfloat16", seed=0, num_threads=args.threads, num_gpu_blocks=blocks)
    for i in range(args.warmup):
        print(f"warm-up prefill step: {prefill_step(ex, args.batch, args.prompt_len, i):.1f} ms", flush=True)
    # The model runs on the executor's own thread: the profiler goes around
    # the forward there, on the prefill step only.
    forward, found = DecoderModel.forward, {}

    def profiled(model: DecoderModel, input_ids: torch.Tensor, *rest: object, **kw: object) -> torch.Tensor:
        if input_ids.shape[0] < args.batch * args.prompt_len:
            return forward(model, input_ids, *rest, **kw)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            out = forward(model, input_ids, *rest, **kw)
            found["forward_s"] = time.perf_counter() - t0
        found["prof"] = prof
        return out

    DecoderModel.forward = profiled
    try:
        step_ms = prefill_step(ex, args.batch, args.prompt_len, 99)
    finally:
        DecoderModel.forward = forward
        ex.close()
    events = found["prof"].key_averages()
    by_op = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in events), key=lambda r: -r[1])
    buckets: dict[str, float] = defaultdict(float)
    for name, ms, _ in by_op:
        buckets[bucket(name)] += ms
    total = sum(buckets.values())
    shape = f"{args.batch} x {args.prompt_len} tokens, {args.threads} thread(s)"
    print(f"profiled prefill step: {step_ms:.1f} ms ({shape})")
    for label, ms in sorted(buckets.items(), key=lambda kv: -kv[1]):
        print(f"  {label:>13}: {ms:8.1f} ms  {100 * ms / total:5.1f}%")
    print("top ops (self time):")
    for name, ms, count in by_op[:12]:
        print(f"  {name:<52} {ms:8.1f} ms  {count:5d} calls  [{bucket(name)}]")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "step_ms": step_ms,
            "buckets_ms": dict(buckets),
            "ops": [{"name": n, "self_ms": ms, "calls": c} for n, ms, c in by_op],
        }
        args.json.write_text(json.dumps(record_cpu(out), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
