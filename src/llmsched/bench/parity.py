"""Decision parity between two step traces (ours and vLLM's)."""

from __future__ import annotations

import json
from pathlib import Path


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


def decisions(steps: list[dict]) -> list[tuple]:
    """(sched, preempted, finished, KV loads, encoder inputs, evictions) of each step that scheduled tokens.

    With a KV connector, a step that only started a load counts too; with
    encoder inputs, a step that only evicted from the encoder cache.
    """
    return [
        (
            [tuple(x) for x in s["sched"]],
            frozenset(s["preempted"]),
            frozenset(s["finished"]),
            [tuple(x) for x in s.get("kv_loads") or ()],
            sorted((rid, tuple(ids)) for rid, ids in (s.get("enc") or {}).items()),
            list(s.get("enc_freed") or ()),
        )
        for s in steps
        if s["total_tokens"] > 0 or s.get("kv_loads") or s.get("enc_freed")
    ]


def compare(ours: list[dict], ref: list[dict], limit: int = 5) -> list[str]:
    """Differences in decisions, first ``limit`` of them; empty when they agree."""
    a, b = decisions(ours), decisions(ref)
    diffs = []
    names = ("sched", "preempted", "finished", "kv_loads", "enc", "enc_freed")
    ordered = (True, False, False, True, True, True)
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            parts = [
                f"{names[j]}: ours {x[j] if ordered[j] else sorted(x[j])} "
                f"vs ref {y[j] if ordered[j] else sorted(y[j])}"
                for j in range(len(names))
                if x[j] != y[j]
            ]
            diffs.append(f"non-empty step #{k}: " + "; ".join(parts))
            if len(diffs) >= limit:
                break
    if len(a) != len(b) and len(diffs) < limit:
        diffs.append(f"ours has {len(a)} non-empty steps, ref {len(b)}")
    return diffs
