"""The least-loaded router: spreads bursts, follows reports, rotates ties."""

from __future__ import annotations

from collections import Counter

import pytest

from llmsched.core import Request, RequestRejected, SamplingParams, SchedulerConfig
from llmsched.engine.dp import DPConfig, DPEngine, LeastLoadedRouter
from llmsched.engine.dp.router import WAITING_WEIGHT
from llmsched.engine.dp.sim_transport import SimTransport
from llmsched.executor.sim.cost_model import ConstantCostModel


def route(router: LeastLoadedRouter, n: int) -> list[int]:
    out = []
    for _ in range(n):
        r = router.choose()
        router.routed(r)
        out.append(r)
    return out


def test_a_burst_with_no_reports_spreads_evenly_in_rotation() -> None:
    router = LeastLoadedRouter(4)
    ranks = route(router, 10)
    assert ranks[:4] == [0, 1, 2, 3]
    assert Counter(ranks) == {0: 3, 1: 3, 2: 2, 3: 2}


def test_reports_steer_new_requests_to_the_least_loaded_rank() -> None:
    router = LeastLoadedRouter(3)
    router.update(0, running=10, waiting=0, received=0)
    router.update(1, running=2, waiting=3, received=0)
    router.update(2, running=5, waiting=0, received=0)
    # Scores: 10, 4*3+2 = 14, 5.
    assert router.loads() == [10, WAITING_WEIGHT * 3 + 2, 5]
    # Each routed request counts as waiting: 5 -> 9 (still below 10) -> 13.
    assert route(router, 2) == [2, 2]
    assert router.loads() == [10, 14, 13]
    assert router.choose() == 0


def test_requests_a_rank_has_not_yet_reported_count_as_waiting() -> None:
    router = LeastLoadedRouter(2)
    route(router, 4)  # two each, unreported
    # Rank 0 reports it received both and runs them; rank 1's are still in flight.
    router.update(0, running=2, waiting=0, received=2)
    assert router.loads() == [2, 2 * WAITING_WEIGHT]
    assert router.choose() == 0


def test_ties_rotate_past_the_last_choice() -> None:
    router = LeastLoadedRouter(3)
    for r in range(3):
        router.update(r, running=1, waiting=0, received=0)
    first = route(router, 3)
    assert sorted(first) == [0, 1, 2]


def test_rejected_requests_are_not_counted_and_the_engine_spreads_a_burst() -> None:
    cfg = SchedulerConfig(num_gpu_blocks=64, max_model_len=128, max_num_batched_tokens=256, max_num_seqs=8)
    tr = SimTransport(cfg, ConstantCostModel(1.0), DPConfig(4, lockstep=True))
    eng = DPEngine(tr)
    ranks = [
        eng.add_request(Request(str(i), [1, 2, 3, i], SamplingParams(max_tokens=2, ignore_eos=True)))
        for i in range(12)
    ]
    assert Counter(ranks) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert [len(r.scheduler.waiting) for r in tr.ranks] == [3, 3, 3, 3]
    with pytest.raises(RequestRejected):
        eng.add_request(Request("too-long", list(range(200)), SamplingParams(max_tokens=2)))
    with pytest.raises(RequestRejected, match="already in use"):
        eng.add_request(Request("0", [1, 2], SamplingParams(max_tokens=2)))
    assert sum(len(r.scheduler.waiting) for r in tr.ranks) == 12
    results = eng.run()
    assert len(results) == 12 and all(r.finish_reason == "length" for r in results.values())
    assert {r.rank for r in results.values()} == {0, 1, 2, 3}
