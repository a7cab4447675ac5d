"""Figures the engine loop adds to its snapshots: why requests wait, the cache settings, KV residency."""

from __future__ import annotations

from llmsched.core.kv.residency import BlockResidency
from llmsched.core.request import RequestStatus
from llmsched.core.trace import Reason, StepTrace
from llmsched.engine.llm_engine import LLMEngine

# A waiting request the latest step's trace does not mention sat behind the ones it did.
UNLISTED = Reason.QUEUED.value
# With tracing off the scheduler gives no reasons; the gauge says so rather than guessing.
UNTRACED = "untraced"
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def waiting_by_reason(engine: LLMEngine, trace: StepTrace | None) -> tuple[tuple[str, int], ...]:
    """(reason, count) over the waiting requests, from the latest scheduled step's decision trace."""
    sched = engine.scheduler
    num_waiting = len(sched.waiting)
    if num_waiting == 0:
        return ()
    if trace is None:
        return ((UNTRACED, num_waiting),)
    last: dict[str, str] = {}
    for e in trace.entries:
        last[e.request_id] = e.reason.value
    counts: dict[str, int] = {}
    requests = sched.requests
    for rid, reason in last.items():
        req = requests.get(rid)
        if req is not None and req.status in _WAITING:
            counts[reason] = counts.get(reason, 0) + 1
    # Requests queued after the step was planned, and those the trace only counted.
    rest = num_waiting - sum(counts.values())
    if rest > 0:
        counts[UNLISTED] = counts.get(UNLISTED, 0) + rest
    return tuple(sorted(counts.items()))


def cache_config_labels(engine: LLMEngine) -> dict[str, str]:
    """The KV cache settings as label values, under the names of vLLM's CacheConfig fields."""
    cfg = engine.scheduler_config
    args = engine.engine_args
    return {
        "block_size": str(cfg.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "gpu_memory_utilization": str(args.gpu_memory_utilization),
        "num_gpu_blocks": str(cfg.num_gpu_blocks),
        "num_gpu_blocks_override": str(args.num_gpu_blocks_override),
        "prefix_caching_hash_algo": cfg.prefix_caching_hash_algo,
    }


def encoder_cache_figures(sched: object) -> tuple[float, int, int, int] | None:
    """(usage, entries, items found cached, items encoded) of the encoder cache; None without one."""
    enc = getattr(sched, "_enc", None)
    if enc is None:
        return None
    c = enc.cache
    return (c.num_used / c.size if c.size else 0.0, len(c), c.num_hits, c.num_allocated)


def attach_residency(engine: LLMEngine, sample_rate: float) -> BlockResidency | None:
    """Start sampling KV block residency in the engine's block pool (0 leaves it off)."""
    if sample_rate <= 0:
        return None
    residency = BlockResidency(sample_rate)
    engine.scheduler.kv.pool.residency = residency
    return residency


def drain_evictions(residency: BlockResidency | None) -> tuple[tuple[float, float, tuple[float, ...]], ...]:
    """The sampled block lives that ended since the last call, as plain tuples."""
    if residency is None:
        return ()
    return tuple((e.lifetime, e.idle, e.reuse_gaps) for e in residency.drain())
