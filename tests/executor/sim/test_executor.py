"""SimExecutor: the Executor protocol, fabricated tokens, batch sums and the virtual clock."""

from __future__ import annotations

import pytest

from llmsched.core import Request, SamplingParams, Scheduler, SchedulerConfig
from llmsched.engine import EngineCore, Executor
from llmsched.executor.sim.cost_model import BatchShape, ConstantCostModel, CostModel
from llmsched.executor.sim.executor import SimExecutor
from llmsched.executor.sim.hardware import load_hardware
from llmsched.executor.sim.model_shapes import load_model


class Recorder:
    """A cost model that remembers the batches it priced."""

    def __init__(self) -> None:
        self.batches: list[BatchShape] = []

    def step_time(self, batch: BatchShape) -> float:
        self.batches.append(batch)
        return 0.5


def req(rid: str, n: int, out: int = 4) -> Request:
    return Request(
        rid, list(range(1000 * len(rid) + n, 1000 * len(rid) + 2 * n)), SamplingParams(max_tokens=out)
    )


def test_implements_the_executor_protocol():
    assert isinstance(SimExecutor(ConstantCostModel()), Executor)


def test_batch_sums_tokens_and_clock():
    cfg = SchedulerConfig(num_gpu_blocks=200, max_model_len=1024, max_num_batched_tokens=100, max_num_seqs=8)
    sched = Scheduler(cfg)
    rec = Recorder()
    ex = SimExecutor(rec, sample_token_id=9)
    sched.add_request(req("a", 30))
    sched.add_request(req("b", 120))
    out = sched.schedule()
    # a: whole prompt (30 tokens); b: 70 of 120 (budget).
    assert out.num_scheduled_tokens == [30, 70]
    res = ex.execute(out)
    assert res.sampled_token_ids == [(9,), ()]
    assert ex.now == 0.5 and ex.last_duration == 0.5
    b = rec.batches[-1]
    assert (b.num_tokens, b.num_sampled, b.prefill_tokens) == (100, 1, 100)
    assert b.prefill_pairs == 30 * 31 // 2 + 70 * 71 // 2
    assert b.prefill_context == 0 and b.num_decodes == 0
    assert [r.request_id for r in ex.last_sampled] == ["a"]
    sched.update_from_output(out, res)
    out = sched.schedule()
    # a decodes at position 30 (31 keys); b's remaining 50 tokens start at 70.
    assert out.num_scheduled_tokens == [1, 50]
    res = ex.execute(out)
    assert res.sampled_token_ids == [(9,), (9,)]
    b = rec.batches[-1]
    assert (b.num_decodes, b.decode_context) == (1, 31)
    assert (b.prefill_tokens, b.prefill_context) == (50, 70)
    assert b.prefill_pairs == sum(range(71, 121))
    assert ex.now == 1.0


def test_matches_batch_shape_from_chunks():
    cm = CostModel(load_model("llama-3-8b"), load_hardware("h100"))
    cfg = SchedulerConfig(num_gpu_blocks=500, max_model_len=2048, max_num_batched_tokens=256, max_num_seqs=8)
    engine = EngineCore(cfg, SimExecutor(cm))
    for i in range(5):
        engine.add_request(req(str(i) * (i + 1), 100 + 37 * i, out=3))
    t = 0.0
    while engine.has_requests():
        es = engine.step()
        so = es.scheduler_output
        if not so.scheduled:
            continue
        sampled = sum(1 for s in es.model_output.sampled_token_ids if s)
        expected = BatchShape.from_chunks([(s, n) for _, s, n in so.chunks()], sampled)
        ex = engine.executor
        assert ex.last_batch == expected
        t += cm.step_time(expected)
        assert ex.now == pytest.approx(t)


def test_empty_batch_costs_nothing():
    ex = SimExecutor(ConstantCostModel(3.0))
    from llmsched.core.output import SchedulerOutput

    res = ex.execute(SchedulerOutput(step=0, finished_req_ids=["x"]))
    assert list(res.sampled_token_ids) == []
    assert ex.now == 0.0
    ex.advance_to(5.0)
    ex.advance_to(2.0)
    assert ex.now == 5.0


def _async_calls_one_by_one(ex, first, d, ctx, k, until, last_shape, sampled_at):
    """What the per-call path does for ``k`` async decode calls: execute each, then apply the step before."""
    from array import array

    ends, gaps, itl = [], array("d"), {}
    sums = [0.0, 0.0, 0.0]
    for j in range(k):
        if ex.now >= until:
            break
        if j == k - 1 and last_shape is not None:
            dl, cl = last_shape
            batch = BatchShape(dl, dl, 0, 0, 0, dl, cl, 0)
        else:
            batch = BatchShape(d, d, 0, 0, 0, d, ctx + d * (j + 1), 0)
        ex._run(first + j, batch)
        prev = ex.timing(first + j - 1)
        ex.advance_to(prev.end)
        ends.append(prev.end)
        gaps.append(prev.host_gap)
        sums[0] += prev.host
        sums[1] += prev.model
        sums[2] += prev.host_gap
        gap = prev.end - sampled_at
        itl[gap] = itl.get(gap, 0) + d
        sampled_at = prev.end
    return ends, list(gaps), itl, sums


def _after(ex, first, n):
    """The executor's clock and the two timings it keeps after ``n`` calls from ``first``."""
    kept = []
    for step in (first + n - 2, first + n - 1):
        t = ex.timing(step)
        kept.append(
            None if t is None else (t.step, t.start, t.end, t.host, t.model, t.host_gap, t.duration, t.batch)
        )
    return ex.now, ex.device_free_at, ex.last_duration, kept


@pytest.mark.parametrize("unrolled", [True, False])
@pytest.mark.parametrize("overlaps", [True, False])
@pytest.mark.parametrize("model", ["llama-3-8b", "bamba-9b", "constant"])
def test_async_decode_runs_clock_and_count_as_the_calls_one_by_one(model, overlaps, unrolled, monkeypatch):
    # run_async_decodes (one loop: price, pipeline, apply, count) against the
    # per-call path's execute-then-apply, on every clock it may generate.
    from array import array
    from types import SimpleNamespace

    from llmsched.executor.sim import cost_model as cost_model_module

    if not unrolled:
        monkeypatch.setattr(cost_model_module, "_UNROLLED", 0)
    if model == "constant":
        cost = ConstantCostModel(0.004, host_seconds=0.006 if overlaps else 0.001)
    else:
        cost = CostModel(load_model(model), load_hardware("h100"))
    cases = [
        (3, 700, 40, 1e9, None),
        (3, 700, 40, 0.05, None),  # an arrival ends the run early
        (5, 2000, 12, 1e9, (3, 3 * 2013)),  # the last call schedules fewer: two finish
        (64, 64 * 900, 25, 1e9, (63, 63 * 926)),
        (4, 4 * 1010, 30, 1e9, None),  # across the KV rate's 1024-token knot
        (2, 2 * 4090, 20, 1e9, None),  # and its 4096-token one
        (1, 10, 1, 1e9, None),
        (2, 10, 7, 0.0, None),  # nothing begins before the limit
    ]
    for d, ctx, k, until, last_shape in cases:
        runs = []
        for fast in (False, True):
            ex = SimExecutor(cost, async_scheduling=True)
            ex.host_overlaps_model = overlaps
            # A prefill in flight before the calls, its forward still running.
            ex._run(
                9, BatchShape(1024, 1, 1024, 1024 * 1025 // 2, 0, 0, 0, 1, prefill_causal=1024 * 1025 // 2)
            )
            if fast:
                costs = SimpleNamespace(
                    num_steps=0, host_s=0.0, model_s=0.0, host_gap_s=0.0, host_gaps=array("d")
                )
                itl: dict[float, int] = {}
                ends = ex.run_async_decodes(10, d, ctx, k, until, last_shape, costs, itl, -0.5)
                n = len(ends)
                got = (
                    list(ends),
                    list(costs.host_gaps),
                    itl,
                    [costs.host_s, costs.model_s, costs.host_gap_s],
                )
                assert costs.num_steps == n
            else:
                got = _async_calls_one_by_one(ex, 10, d, ctx, k, until, last_shape, -0.5)
                n = len(got[0])
            runs.append((n, got, _after(ex, 10, n)))
        assert runs[0] == runs[1]
        n = runs[0][0]
        assert n == (0 if until == 0.0 else k) or (until == 0.05 and 0 < n < k)
