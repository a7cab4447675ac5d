"""Decision parity between two step traces (ours and vLLM's)."""

from __future__ import annotations

import json
from pathlib import Path

# What each compared step carries, in order; all of it is compared as
# recorded (lists in their recorded order) except where noted.
FIELDS = ("sched", "admitted", "preempted", "finished", "kv_loads", "enc", "enc_freed", "blocks", "drafts")


def load_trace(path: str | Path) -> list[dict]:
    """Step records of a JSONL trace, header skipped."""
    steps = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if "header" not in rec:
                    steps.append(rec)
    return steps


def decisions(
    steps: list[dict], blocks: bool = True, preempt_order: bool = True, finish_order: bool = True
) -> list[tuple]:
    """The decisions (``FIELDS``) of each step that scheduled tokens.

    ``sched``, ``admitted``, ``preempted``, ``finished``, ``kv_loads`` and
    ``enc_freed`` keep their recorded order; ``enc`` (encoder inputs per
    request) and ``blocks`` (block ids handed over per request) are compared
    per request. ``blocks`` is None when the trace does not record it or
    ``blocks`` is false. With a KV connector, a step that only started a load
    counts too; with encoder inputs, a step that only evicted from the
    encoder cache. ``drafts`` (draft tokens scheduled per request, with
    speculative decoding) is compared per request. ``preempt_order`` false compares a step's preemptions as
    a set (traces that do not record vLLM's order), ``finish_order`` false
    its finishes (where vLLM's order is not deterministic).
    """
    pkey = list if preempt_order else sorted
    fkey = list if finish_order else sorted
    return [
        (
            [tuple(x) for x in s["sched"]],
            [tuple(x) for x in s.get("admitted") or ()],
            pkey(s["preempted"]),
            fkey(s["finished"]),
            [tuple(x) for x in s.get("kv_loads") or ()],
            sorted((rid, tuple(ids)) for rid, ids in (s.get("enc") or {}).items()),
            list(s.get("enc_freed") or ()),
            s.get("blocks") if blocks else None,
            sorted((s.get("drafts") or {}).items()),
        )
        for s in steps
        if s["total_tokens"] > 0 or s.get("kv_loads") or s.get("enc_freed")
    ]


def records_blocks(steps: list[dict]) -> bool:
    """True if the trace records the block ids handed over each step."""
    return any("blocks" in s for s in steps)


def finish_order_is_deterministic(workload: dict) -> bool:
    """False if vLLM may list one step's finishes in an order that varies between runs.

    vLLM finishes the requests that failed (a KV load under the "fail"
    policy, an encoder input whose size disagrees with the cached one) by
    iterating a set of ids, whose order follows Python's string hashing.
    """
    kv = workload.get("config", {}).get("kv_connector") or {}
    fail_loads = kv.get("load_failure_policy", "recompute") == "fail"
    return not fail_loads and not any(r.get("mm") for r in workload.get("requests", ()))


def compare(
    ours: list[dict],
    ref: list[dict],
    limit: int = 5,
    preempt_order: bool = True,
    finish_order: bool = True,
) -> list[str]:
    """Differences in decisions, first ``limit`` of them; empty when they agree.

    Block ids are compared where both traces record them (replay always
    does; the simulator does not list block ids); the orders as in
    ``decisions``.
    """
    with_blocks = records_blocks(ref) and records_blocks(ours)
    a = decisions(ours, with_blocks, preempt_order, finish_order)
    b = decisions(ref, with_blocks, preempt_order, finish_order)
    diffs = []
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            parts = [f"{FIELDS[j]}: ours {x[j]} vs ref {y[j]}" for j in range(len(FIELDS)) if x[j] != y[j]]
            diffs.append(f"non-empty step #{k}: " + "; ".join(parts))
            if len(diffs) >= limit:
                break
    if len(a) != len(b) and len(diffs) < limit:
        diffs.append(f"ours has {len(a)} non-empty steps, ref {len(b)}")
    return diffs
