"""Hybrid (Mamba2) models in the cost model and memory plan: state blocks priced, state that does not grow."""

from __future__ import annotations

import pytest

from llmsched.executor.sim.cost_model import BatchShape, CostModel
from llmsched.executor.sim.hardware import load_hardware
from llmsched.executor.sim.memory import hybrid_block_size, mamba_state_bytes, plan_memory
from llmsched.executor.sim.model_shapes import load_model, shape_from_hf_config

H100 = load_hardware("h100")


def decode_ms(cm: CostModel, n: int, ctx: int) -> float:
    return cm.step_time(BatchShape(n, n, 0, 0, 0, n, n * ctx, 0)) * 1e3


def test_bamba_shape_from_its_config() -> None:
    m = load_model("bamba-9b")
    assert (m.num_attention_layers, m.num_mamba_layers) == (3, 29)
    assert m.mamba_d_inner == 2 * m.hidden_size
    assert m.num_params() / 1e9 == pytest.approx(9.8, abs=0.1)
    # conv window (3 x (8192 + 2 x 128)) plus SSM state (128 heads x 64 x 128), bf16, 29 layers.
    assert mamba_state_bytes(m, 1) == 29 * (3 * 8448 + 128 * 64 * 128) * 2
    # layers_block_type (Jamba-style configs) counts the same way.
    cfg: dict = {"hidden_size": 64, "num_hidden_layers": 4}
    cfg.update(
        num_attention_heads=4, mamba_n_heads=8, layers_block_type=["mamba", "attention", "mamba", "mamba"]
    )
    assert shape_from_hf_config(cfg).num_mamba_layers == 3


def test_decode_at_long_context_is_cheaper_than_attention_only() -> None:
    hybrid = CostModel(load_model("bamba-9b"), H100)
    dense = CostModel(load_model("llama-3-8b"), H100)
    assert decode_ms(hybrid, 64, 32768) < decode_ms(dense, 64, 32768) / 3
    # Only the 3 attention layers (of 32, same heads) read a growing KV; the states stay the same size.
    growth_h = decode_ms(hybrid, 64, 32768) - decode_ms(hybrid, 64, 1024)
    growth_d = decode_ms(dense, 64, 32768) - decode_ms(dense, 64, 1024)
    assert growth_h / growth_d == pytest.approx(3 / 32, rel=0.02)
    # The mixers are priced: a decode reads and writes every request's state.
    ops = {o.name: o for o in hybrid.ops(BatchShape(64, 64, 0, 0, 0, 64, 64 * 1024, 0))}
    assert ops["mamba_mixer"].bytes >= 64 * 2 * mamba_state_bytes(hybrid.model, 1)
    assert ops["mamba_linears"].flops > 0
    # Bit for bit: the fast decode pricing and step_parts agree with step_time.
    b = BatchShape(64, 64, 0, 0, 0, 64, 64 * 4096, 0)
    assert hybrid.decode_step_parts(64)(64 * 4096) == hybrid.step_parts(b)
    assert hybrid.step_parts(b)[0] == hybrid.step_time(b)


def test_state_blocks_take_kv_capacity_as_computed() -> None:
    m = load_model("bamba-9b")
    bs = hybrid_block_size(m, 1, 16, None)
    per_token = 3 * 2 * 8 * 128 * 2
    state = mamba_state_bytes(m, 1)
    # The largest power of two whose attention block is no larger than a state.
    assert per_token * bs <= state < per_token * 2 * bs
    plan = plan_memory(m, H100, block_size=bs, max_model_len=32768)
    avail = plan.device_bytes * plan.gpu_memory_utilization - plan.weight_bytes - plan.activation_bytes
    assert plan.num_gpu_blocks == int((avail - plan.reserve_bytes) // state)
    # A request of max_model_len holds its KV blocks plus a state block.
    assert plan.max_concurrency == pytest.approx((plan.num_gpu_blocks - 1) / (32768 // bs + 1))
    assert hybrid_block_size(load_model("llama-3-8b"), 1, 16, None) == 16
