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
