"""Scheduler state snapshots and request feeds for tests of steps applied without building batches."""

from __future__ import annotations

import random

from llmsched.core import SamplingParams, Scheduler
from support.scheduling import make_req


def snapshot(s: Scheduler) -> dict:
    """Everything a later step can read: requests, block tables, the free queue, the cache, counters."""
    kv = s.kv
    pool = kv.pool
    return {
        "step": s.next_step,
        "executed": s._num_executed_steps,
        "capacity_bound": s._prefill_capacity_bound,
        "running": [
            (r.request_id, r.num_computed_tokens, r.num_tokens, list(r.token_ids), r.is_prefill_chunk)
            for r in s.running
        ],
        "waiting": [r.request_id for r in s.waiting],
        "tables": {rid: ([b.block_id for b in t.blocks], t.num_cached) for rid, t in kv._tables.items()},
        "free": [b.block_id for b in pool.free_queue],
        "hashes": [(b.block_id, b.block_hash, b.ref_cnt) for b in pool.blocks],
        "cached": sorted(
            (h, [x.block_id for x in v] if isinstance(v, list) else v.block_id)
            for h, v in pool._cached.items()
        ),
        "usage": s.kv_usage,
        "finished_ids": list(s._finished_ids),
    }


def feed(scheds: list[Scheduler], rng: random.Random, n: int, shared: list[int]) -> None:
    """The same new requests into every scheduler (some share a prefix, some stop on token 7)."""
    for i in range(n):
        rid = f"r{rng.randrange(10**9)}"
        plen = rng.randrange(3, 60)
        max_tokens = rng.randrange(1, 40)
        stop = [7] if rng.random() < 0.1 else []
        for s in scheds:
            req = make_req(rid, plen, params=SamplingParams(max_tokens=max_tokens, stop_token_ids=stop))
            if i % 3 == 0:
                req.token_ids[: len(shared)] = shared[:plen]
                req.prompt_token_ids = list(req.token_ids)
            s.add_request(req)
