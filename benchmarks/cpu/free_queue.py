#!/usr/bin/env python3
"""The free-block queue's removal from the middle (a prefix-cache hit on a free block): time per removal.

For each queue length, removes the middle half of the blocks in a random
order and reports nanoseconds per removal (best of --repeats). O(1)
removal shows as a flat column across lengths; the tests check the
constant cost by counting link reads and writes, not by the clock.

    python benchmarks/cpu/free_queue.py [--lengths 1000 10000 100000] [--json results/free_queue.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.core.kv.block import KVBlock  # noqa: E402
from llmsched.core.kv.free_queue import FreeBlockQueue  # noqa: E402


def removal_ns(n: int, seed: int) -> float:
    """Nanoseconds per removal of the middle half of a queue of ``n`` blocks, in random order."""
    blocks = [KVBlock(i) for i in range(n)]
    q = FreeBlockQueue(blocks)
    victims = blocks[n // 4 : 3 * n // 4]
    random.Random(seed).shuffle(victims)
    t0 = time.perf_counter_ns()
    for b in victims:
        q.remove(b)
    return (time.perf_counter_ns() - t0) / len(victims)


def main() -> int:
    """Time per removal for each length; figures and JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=ROOT / "results/free_queue.json")
    args = p.parse_args()
    if min(args.lengths) < 4 or args.repeats < 1:
        p.error("--lengths must each be at least 4 and --repeats at least 1")
    rows = []
    for n in args.lengths:
        best = min(removal_ns(n, seed) for seed in range(args.repeats))
        rows.append({"blocks": n, "removals": 3 * n // 4 - n // 4, "ns_per_removal": best})
        print(f"{n:>9} blocks: {best:7.1f} ns per removal (best of {args.repeats})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record_cpu({"repeats": args.repeats, "rows": rows}), indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
