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
    """(sched, preempted set, finished set) of every step that scheduled tokens."""
    return [
        (
            [tuple(x) for x in s["sched"]],
            frozenset(s["preempted"]),
            frozenset(s["finished"]),
        )
        for s in steps
        if s["total_tokens"] > 0
    ]


def compare(ours: list[dict], ref: list[dict], limit: int = 5) -> list[str]:
    """Differences in decisions, first ``limit`` of them; empty when they agree."""
    a, b = decisions(ours), decisions(ref)
    diffs = []
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            names = ("sched", "preempted", "finished")
            parts = [
                f"{names[j]}: ours {sorted(x[j]) if j else x[j]} vs ref {sorted(y[j]) if j else y[j]}"
                for j in range(3)
                if x[j] != y[j]
            ]
            diffs.append(f"non-empty step #{k}: " + "; ".join(parts))
            if len(diffs) >= limit:
                break
    if len(a) != len(b) and len(diffs) < limit:
        diffs.append(f"ours has {len(a)} non-empty steps, ref {len(b)}")
    return diffs
