"""Lazy prefix-cache registration (core.kv.deferred): every decision equals eager registration."""

from __future__ import annotations

import random

import pytest

from llmsched.core import SamplingParams, Scheduler
from llmsched.core.kv.deferred import Deferred
from llmsched.core.kv.manager import KVCacheManager
from llmsched.core.request import Request
from support.scheduling import make_req, make_sched, run_step


def decisions(s: Scheduler) -> tuple:
    """One step's decisions, by request id and block id, and the free queue after it."""
    out, res = run_step(s)
    return (
        [(r.request_id, n) for r, n in zip(out.scheduled, out.num_scheduled_tokens)],
        sorted(out.new_block_ids.items()),
        out.admitted_block_ids,
        out.admitted_num_cached_tokens,
        [r.request_id for r in out.preempted],
        [r.request_id for r in res.finished],
        [b.block_id for b in s.kv.pool.free_queue],
        s.prefix_cache_stats.hits,
    )


def feed(scheds: list[Scheduler], rng: random.Random, shared: list[list[int]]) -> None:
    """The same new requests into each scheduler; most share one of a few prefixes."""
    rid = f"r{rng.randrange(10**9)}"
    plen = rng.randrange(2, 90)
    prefix = rng.choice(shared) if rng.random() < 0.7 else []
    max_tokens = rng.randrange(1, 30)
    for s in scheds:
        req = make_req(rid, plen, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        n = min(len(prefix), plen)
        req.token_ids[:n] = prefix[:n]
        req.prompt_token_ids = list(req.token_ids)
        s.add_request(req)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("num_gpu_blocks", [30, 80, 257])
def test_lazy_registration_decides_as_eager(seed: int, num_gpu_blocks: int) -> None:
    rng = random.Random(seed)
    eager, lazy = make_sched(num_gpu_blocks=num_gpu_blocks), make_sched(num_gpu_blocks=num_gpu_blocks)
    lazy.kv.lazy_registration = True
    shared = [[500_000 + 1000 * k + j for j in range(70)] for k in range(3)]
    deferred_seen = False
    for _ in range(150):
        for _ in range(rng.choice([0, 0, 1, 2])):
            feed([eager, lazy], rng, shared)
        assert decisions(lazy) == decisions(eager)
        deferred_seen = deferred_seen or bool(lazy.kv.pool.deferred)
    # The lazy pool did hold registrations back, and the runs hit the cache.
    assert deferred_seen and eager.prefix_cache_stats.hits > 0


def test_a_prompt_nobody_shares_registers_one_block() -> None:
    kv = KVCacheManager(num_blocks=40, block_size=4, max_model_len=128)
    kv.lazy_registration = True
    req = Request("a", list(range(100, 132)), SamplingParams(max_tokens=4))
    hit, n = kv.get_computed_blocks(req)
    assert (hit, n) == ([], 0)
    blocks = kv.allocate_new(req, 32)
    assert kv.pool.num_cached_blocks() == 1 and len(req.block_hashes) == 1
    assert all(type(b.block_hash) is Deferred for b in blocks[1:])
    # A second request with the same prompt hits it all but the last token's block.
    twin = Request("b", list(range(100, 132)), SamplingParams(max_tokens=4))
    hit, n = kv.get_computed_blocks(twin)
    assert hit == blocks[:7] and n == 28
    assert kv.pool.deferred == {} and len(req.block_hashes) == 8
    assert [b.block_hash for b in blocks] == req.block_hashes


def test_only_managers_that_declare_it_take_lazy_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmsched.core.kv.hybrid import HybridKVCacheManager
    from llmsched.sim import DeploymentSpec, build_deployment, simulate, synthetic_workload
    from llmsched.sim.one_engine import OneEngine

    assert KVCacheManager.supports_lazy_registration
    # Each hybrid registration also caches a Mamba state: kept eager.
    assert not HybridKVCacheManager.supports_lazy_registration
    seen = {}
    init = OneEngine.__init__

    def spy(self: OneEngine, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        seen[type(self.sched.kv)] = self.sched.kv.lazy_registration

    monkeypatch.setattr(OneEngine, "__init__", spy)
    for model in ("llama-3-8b", "bamba-9b"):
        simulate(build_deployment(DeploymentSpec(model=model, hardware="h100")), synthetic_workload(2, 64, 2))
    assert seen == {KVCacheManager: True, HybridKVCacheManager: False}
