"""The simulator prices LoRA shrink/expand products: FLOPs per adapter token, weight bytes per adapter."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmsched.core import Request, SamplingParams
from llmsched.core.errors import ConfigError
from llmsched.core.output import SchedulerOutput
from llmsched.executor.sim.cost_model import BatchShape, CostModel
from llmsched.executor.sim.executor import SimExecutor

from .test_cost_model import PERFECT, TINY, UNIT_HW

# in + out features of q, k, v, o, gate, up, down of TINY (q 64, kv 32, inter 128), per layer.
WIDTHS = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)


def lora_op(cm: CostModel, batch: BatchShape):
    return {op.name: op for op in cm.ops(batch)}.get("lora")


def test_lora_products_are_priced_by_rank_tokens_and_adapters() -> None:
    cm = CostModel(TINY, UNIT_HW, efficiency=PERFECT, step_overhead_s=0.0, lora_rank=8)
    base = BatchShape.from_chunks([(0, 8), (10, 1), (20, 1)], num_sampled=3)
    assert lora_op(cm, base) is None
    one = replace(base, lora_tokens=9, num_loras=1)
    op = lora_op(cm, one)
    assert op.flops == 2 * 9 * 8 * WIDTHS * TINY.num_layers
    two = replace(base, lora_tokens=9, num_loras=2)
    assert lora_op(cm, two).bytes - op.bytes == 8 * WIDTHS * TINY.num_layers * TINY.dtype_bytes
    assert cm.step_time(one) == cm.step_time(base) + op.seconds
    # step_parts' cached path gives the same total, bit for bit, with the product on the model side.
    total, host, model = cm.step_parts(one)
    assert total == cm.step_time(one)
    assert model - cm.step_parts(base)[2] == pytest.approx(op.seconds)
    assert host == cm.step_parts(base)[1]
    # Without a rank, adapter tokens cost nothing extra.
    off = CostModel(TINY, UNIT_HW, efficiency=PERFECT, step_overhead_s=0.0)
    assert off.step_time(one) == off.step_time(base)
    with pytest.raises(ConfigError, match="lora_rank"):
        CostModel(TINY, UNIT_HW, lora_rank=-1)


def test_sim_executor_counts_adapter_tokens() -> None:
    cm = CostModel(TINY, UNIT_HW, efficiency=PERFECT, step_overhead_s=0.0, lora_rank=16)
    ex = SimExecutor(cm)
    reqs = [Request(str(i), [1] * 6, SamplingParams(max_tokens=2), lora_id=i % 3) for i in range(6)]
    for r in reqs:
        r.num_computed_tokens = 6
    so = SchedulerOutput(step=0, scheduled=reqs, num_scheduled_tokens=[6] * 6)
    ex.execute(so)
    assert (ex.last_batch.lora_tokens, ex.last_batch.num_loras) == (24, 2)
    with_lora = ex.last_duration
    plain = SimExecutor(CostModel(TINY, UNIT_HW, efficiency=PERFECT, step_overhead_s=0.0))
    plain.execute(so)
    assert plain.last_batch.lora_tokens == 0
    assert with_lora > plain.last_duration
