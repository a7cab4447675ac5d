"""Decision parity between two step traces (ours and vLLM's)."""

from __future__ import annotations

import json
from pathlib import Path

# What each compared step carries, in order; all of it is compared as
# recorded (lists in their recorded order) except where noted.
FIELDS = ("sched", "admitted", "preempted", "finished", "kv_loads", "enc", "enc_freed", "blocks")


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


def decisions(steps: list[dict], blocks: bool = True) -> list[tuple]:
    """The decisions (``FIELDS``) of each step that scheduled tokens.

    ``sched``, ``admitted``, ``preempted``, ``finished``, ``kv_loads`` and
    ``enc_freed`` keep their recorded order; ``enc`` (encoder inputs per
    request) and ``blocks`` (block ids handed over per request) are compared
    per request. ``blocks`` is None when the trace does not record it or
    ``blocks`` is false. With a KV connector, a step that only started a load
    counts too; with encoder inputs, a step that only evicted from the
    encoder cache.
    """
    return [
        (
            [tuple(x) for x in s["sched"]],
            [tuple(x) for x in s.get("admitted") or ()],
            list(s["preempted"]),
            list(s["finished"]),
            [tuple(x) for x in s.get("kv_loads") or ()],
            sorted((rid, tuple(ids)) for rid, ids in (s.get("enc") or {}).items()),
            list(s.get("enc_freed") or ()),
            s.get("blocks") if blocks else None,
        )
        for s in steps
        if s["total_tokens"] > 0 or s.get("kv_loads") or s.get("enc_freed")
    ]


def records_blocks(steps: list[dict]) -> bool:
    """True if the trace records the block ids handed over each step."""
    return any("blocks" in s for s in steps)


def compare(ours: list[dict], ref: list[dict], limit: int = 5) -> list[str]:
    """Differences in decisions, first ``limit`` of them; empty when they agree.

    Block ids are compared where the reference records them.
    """
    with_blocks = records_blocks(ref)
    a, b = decisions(ours, with_blocks), decisions(ref, with_blocks)
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
