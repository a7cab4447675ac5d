#!/usr/bin/env python3
"""A torch-executor prefill step on one thread against its floor: the step's FLOPs at one core's matmul peak.

Loads --model (dtype auto: float32 on CPUs without bfloat16 matmul units)
in a TorchExecutor on one torch thread and runs --repeats prefill steps of
--batch fresh prompts of --prompt-len tokens (1 x 2,048 by default)
through EngineCore, the executor's own code path. The floor is the step's
FLOPs (every linear for every token, causal attention QK and PV for the
visible pairs only, the LM head for the sampled rows only) divided by the
best of several single-thread torch.mm runs at a few sizes, measured in
the same run. Times are taken twice: wall and the process's CPU time; on
a shared machine the CPU-time ratio is the figure to read (a descheduled
thread adds wall time, not CPU time), and the load average is printed.
``--compare-pytorch`` also runs the steps on the PyTorch ops the float32
path ran before its C kernels (SDPA for prefill_attention_f32.c, F.silu
and a multiply for swiglu.c), interleaved with the kernels' steps. One
more step runs under torch.profiler for the breakdown by kind of op
(prefill_profile.py's buckets); the C kernels show as
``llmsched::prefill_attention`` and ``llmsched::swiglu``. ``--accuracy`` then compares each path's
prompt logprobs and greedy tokens with transformers' float32 model on the
same folder. Prints all of it, writes JSON.

    python benchmarks/cpu/prefill_floor.py --model DIR --compare-pytorch --accuracy --json results/pf.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from prefill_profile import bucket  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched import core  # noqa: E402
from llmsched.engine import EngineCore  # noqa: E402
from llmsched.executor.torch import TorchExecutor, kernels, layers  # noqa: E402
from llmsched.executor.torch.attention import PagedAttention  # noqa: E402
from llmsched.executor.torch.config import ModelConfig  # noqa: E402
from llmsched.executor.torch.kernels import PrefillAttentionKernel  # noqa: E402
from llmsched.executor.torch.model import DecoderModel  # noqa: E402


def step_flops(cfg: ModelConfig, batch: int, prompt_len: int) -> dict[str, float]:
    """FLOPs of one prefill step by part: linears, causal attention, LM head (the sampled rows only)."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkvo = h * (2 * cfg.num_heads * d + 2 * cfg.num_kv_heads * d)
    mlp = 3 * h * cfg.intermediate_size
    tokens = batch * prompt_len
    pairs = batch * prompt_len * (prompt_len + 1) / 2
    return {
        "linears": 2.0 * cfg.num_layers * (qkvo + mlp) * tokens,
        "attention": 4.0 * cfg.num_layers * cfg.num_heads * d * pairs,
        "lm_head": 2.0 * h * cfg.vocab_size * batch,
    }


def matmul_peak(sizes: tuple[int, ...] = (1024, 1536, 2048), repeats: int = 8) -> dict[str, float]:
    """One thread's float32 torch.mm peak, GFLOP/s: the best run over sizes, by wall and by CPU time."""
    torch.set_num_threads(1)
    best_wall = best_cpu = 0.0
    for n in sizes:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        torch.mm(a, b, out=c)
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            torch.mm(a, b, out=c)
            c1, t1 = time.thread_time(), time.perf_counter()
            best_wall = max(best_wall, 2 * n**3 / (t1 - t0) / 1e9)
            best_cpu = max(best_cpu, 2 * n**3 / max(c1 - c0, 1e-9) / 1e9)
    return {"wall_gflops": best_wall, "cpu_gflops": best_cpu}


def add_prompts(engine: EngineCore, vocab: int, batch: int, prompt_len: int, seed: int) -> None:
    """``batch`` fresh random prompts that each want one token."""
    gen = torch.Generator().manual_seed(seed)
    params = core.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(core.Request(f"p{seed}-{i}", prompt, params))


def prefill_step(ex: TorchExecutor, batch: int, prompt_len: int, seed: int) -> tuple[float, float, float]:
    """(wall s, process CPU s, model forward's CPU s) of a step prefilling ``batch`` fresh prompts whole."""
    config = core.SchedulerConfig(
        block_size=ex.block_size,
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        max_num_batched_tokens=batch * prompt_len,
        max_num_seqs=max(256, batch),
    )
    engine = EngineCore(config, ex)
    add_prompts(engine, ex.model.config.vocab_size, batch, prompt_len, seed)
    # The forward runs on the executor's thread: its CPU time is taken there.
    forward, forward_cpu = DecoderModel.forward, []

    def timed(model: DecoderModel, *args: object, **kw: object) -> torch.Tensor:
        c = time.thread_time()
        out = forward(model, *args, **kw)
        forward_cpu.append(time.thread_time() - c)
        return out

    DecoderModel.forward = timed
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        step = engine.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        DecoderModel.forward = forward
    done = step.scheduler_output.total_num_scheduled_tokens
    if done != batch * prompt_len:
        raise SystemExit(f"the step prefilled {done} tokens, not {batch * prompt_len}")
    while engine.has_requests():
        engine.step()
    return wall, cpu, sum(forward_cpu)


def use_pytorch(attention: PagedAttention, on: bool, kernel: PrefillAttentionKernel | None) -> None:
    """Run float32 prefill attention and SwiGLU on PyTorch's ops (``on``) or on the C kernels."""
    attention.prefill_kernel_f32 = None if on else kernel
    layers.swiglu_kernel = (lambda: None) if on else kernels.swiglu_kernel


def profiled_step(ex: TorchExecutor, batch: int, prompt_len: int) -> dict[str, float]:
    """Self CPU ms per bucket of one prefill step's forward (torch.profiler), plus the step's own times."""
    forward, found = DecoderModel.forward, {}
    attend, swiglu = PrefillAttentionKernel.attend, kernels.SwiGLUKernel.swiglu

    def traced_attend(kern: PrefillAttentionKernel, *args: object) -> None:
        with record_function("llmsched::prefill_attention"):
            attend(kern, *args)

    def traced_swiglu(kern: kernels.SwiGLUKernel, gate_up: torch.Tensor) -> torch.Tensor:
        with record_function("llmsched::swiglu"):
            return swiglu(kern, gate_up)

    def traced_forward(
        model: DecoderModel, input_ids: torch.Tensor, *rest: object, **kw: object
    ) -> torch.Tensor:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = forward(model, input_ids, *rest, **kw)
        found["prof"] = prof
        return out

    DecoderModel.forward, PrefillAttentionKernel.attend = traced_forward, traced_attend
    kernels.SwiGLUKernel.swiglu = traced_swiglu
    try:
        wall, cpu, _ = prefill_step(ex, batch, prompt_len, 999)
    finally:
        DecoderModel.forward, PrefillAttentionKernel.attend = forward, attend
        kernels.SwiGLUKernel.swiglu = swiglu
    events = found["prof"].key_averages()
    buckets: dict[str, float] = defaultdict(float)
    ops = sorted(((e.key, e.self_cpu_time_total / 1e3) for e in events), key=lambda r: -r[1])
    for name, ms in ops:
        buckets[bucket(name)] += ms
    total = sum(buckets.values())
    return {
        "buckets_ms": dict(buckets),
        "ops_ms": dict(ops[:15]),
        "forward_ms": total,
        "step_wall_ms": 1e3 * wall,
        "step_cpu_ms": 1e3 * cpu,
    }


def summarise(
    label: str, runs: list[tuple[float, float, float]], floor: dict[str, float]
) -> dict[str, float]:
    """Median and best wall and CPU seconds of ``runs``, and the medians' ratios to the floors; printed."""
    wall, cpu = [r[0] for r in runs], [r[1] for r in runs]
    out = {
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "forward_cpu_s": statistics.median(r[2] for r in runs),
        "best_wall_s": min(wall),
        "best_cpu_s": min(cpu),
        "runs": [list(r) for r in runs],
    }
    out["ratio_cpu"] = out["cpu_s"] / floor["cpu_s"]
    out["ratio_wall"] = out["wall_s"] / floor["wall_s"]
    print(
        f"{label}: CPU {out['cpu_s']:.2f} s (best {out['best_cpu_s']:.2f}) = {out['ratio_cpu']:.3f}x floor,"
        f"  wall {out['wall_s']:.2f} s (best {out['best_wall_s']:.2f}) = {out['ratio_wall']:.3f}x;"
        f"  of the CPU time {out['forward_cpu_s']:.2f} s in the model forward, the rest host work"
    )
    return out


def accuracy(folder: str, prompt_len: int, new_tokens: int = 8) -> dict[str, dict]:
    """Each attention path's prompt logprobs and greedy tokens against transformers' float32 model.

    One random prompt of ``prompt_len`` tokens, prefilled whole on one
    thread: the largest and mean |logprob difference| of the prompt's tokens
    over every position, and whether the greedy continuations are equal.
    """
    from transformers import AutoModelForCausalLM

    from llmsched import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, hf.config.vocab_size, (prompt_len,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        want = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, prompt_len),
        )[0, prompt_len:].tolist()
    del hf
    llm = LLM(
        folder,
        dtype="float32",
        num_threads=1,
        skip_tokenizer_init=True,
        max_model_len=prompt_len + new_tokens,
        max_num_batched_tokens=prompt_len,
    )
    attention = llm.llm_engine.executor.model.attention
    kernel = attention.prefill_kernel_f32
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0)
    found = {}
    for path in ("kernels", "pytorch"):
        use_pytorch(attention, path == "pytorch", kernel)
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        diff = torch.tensor(
            [abs(out.prompt_logprobs[i][t].logprob - ref[i - 1, t].item()) for i, t in enumerate(prompt) if i]
        )
        found[path] = {
            "max_abs_logprob_diff": diff.max().item(),
            "mean_abs_logprob_diff": diff.mean().item(),
            "greedy_equal": list(out.outputs[0].token_ids) == want,
        }
        print(f"  accuracy, {path}: {found[path]}")
    return found


def measure(args: argparse.Namespace) -> dict:
    """The floor, the steps (each path interleaved) and the breakdown, as the JSON's body."""
    blocks = args.batch * (-(-(args.prompt_len + 1) // 128) + 1) + 80
    ex = TorchExecutor(
        args.model,
        seed=0,
        num_threads=1,
        num_gpu_blocks=blocks,
        max_num_batched_tokens=args.batch * args.prompt_len,
    )
    kernel = ex.model.attention.prefill_kernel_f32
    paths = ["kernels", "pytorch"] if args.compare_pytorch else ["kernels"]
    flops = step_flops(ex.model.config, args.batch, args.prompt_len)
    total = sum(flops.values())
    load = [os.getloadavg()]
    peak = matmul_peak()
    floor = {"wall_s": total / peak["wall_gflops"] / 1e9, "cpu_s": total / peak["cpu_gflops"] / 1e9}
    print(f"{ex.dtype}, {args.batch} x {args.prompt_len} tokens, 1 thread; {total / 1e12:.4f} TFLOP", flops)
    print(f"matmul peak: {peak['cpu_gflops']:.1f} GFLOP/s by CPU time, {peak['wall_gflops']:.1f} by wall")
    print(f"floor: {floor['cpu_s']:.2f} s (CPU time), {floor['wall_s']:.2f} s (wall)")
    runs: dict[str, list[tuple[float, float, float]]] = {p: [] for p in paths}
    for i in range(args.warmup + args.repeats):
        for p in paths:
            use_pytorch(ex.model.attention, p == "pytorch", kernel)
            r = prefill_step(ex, args.batch, args.prompt_len, i)
            if i >= args.warmup:
                runs[p].append(r)
            note = " (warm-up)" if i < args.warmup else ""
            print(f"  {p} step: {r[1]:.2f} s CPU ({r[2]:.2f} s forward), {r[0]:.2f} s wall{note}", flush=True)
    load.append(os.getloadavg())
    results = {p: summarise(p, runs[p], floor) for p in paths}
    use_pytorch(ex.model.attention, False, kernel)
    breakdown = profiled_step(ex, args.batch, args.prompt_len)
    ex.close()
    return {
        "dtype": str(ex.dtype),
        "flops": flops,
        "matmul_peak": peak,
        "floor": floor,
        "paths": results,
        "breakdown": breakdown,
        "loadavg_before_after": load,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per path (the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per path first")
    p.add_argument(
        "--compare-pytorch",
        action="store_true",
        help="also time the steps on PyTorch's ops instead of the C kernels",
    )
    p.add_argument(
        "--accuracy",
        action="store_true",
        help="also compare prompt logprobs and greedy tokens with transformers",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    out = measure(args)
    if args.accuracy:
        print(f"against transformers (float32), one {args.prompt_len}-token prompt:")
        out["accuracy"] = accuracy(args.model, args.prompt_len)
    b = out["breakdown"]
    total = b["forward_ms"]
    print(
        f"breakdown of one profiled step ({b['step_wall_ms']:.0f} ms wall; self times of the forward's ops):"
    )
    # The profiled times move with the load; each bucket's share of the
    # timed steps' forward CPU time is the estimate to read.
    first = out["paths"][next(iter(out["paths"]))]
    b["cpu_ms_estimate"] = {k: v / total * 1e3 * first["forward_cpu_s"] for k, v in b["buckets_ms"].items()}
    host = 1e3 * (first["cpu_s"] - first["forward_cpu_s"])
    for label, ms in sorted(b["buckets_ms"].items(), key=lambda kv: -kv[1]):
        est = b["cpu_ms_estimate"][label]
        print(f"  {label:>13}: {ms:8.1f} ms  {100 * ms / total:5.1f}%  ~{est:7.1f} ms of the step's CPU time")
    print(f"  {'host work':>13}: ~{host:.1f} ms of the step's CPU time (outside the model forward)")
    for name, ms in b["ops_ms"].items():
        print(f"    {name:<52} {ms:8.1f} ms")
    print("load average (1, 5, 15 min) before / after:", out["loadavg_before_after"])
    out["args"] = {k: str(v) for k, v in vars(args).items()}
    out = record_cpu(out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
