"""The cost model against hand-computed FLOPs and bytes, and its roofline behaviour."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.cost_model import (
    HOST_OPS,
    LAUNCH_EAGER,
    LAUNCH_GRAPH,
    LAUNCH_PIECEWISE,
    BatchShape,
    ConstantCostModel,
    CostModel,
    Efficiency,
    Parallelism,
)
from llmsched.executor.sim.hardware import HardwareProfile, load_hardware
from llmsched.executor.sim.model_shapes import ModelShape, load_model

TINY = ModelShape(
    name="tiny",
    architecture="test",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=1000,
    max_position_embeddings=512,
)
# Round numbers and perfect efficiency so every time is flops/peak or bytes/bandwidth.
UNIT_HW = HardwareProfile(
    name="unit",
    description="unit",
    peak_flops_bf16=1e12,
    peak_flops_fp8=None,
    mem_bandwidth=1e9,
    mem_capacity=1e12,
    link_bandwidth=1e9,
    collective_latency_s=1e-6,
)
PERFECT = Efficiency(gemm=1.0, attention=1.0, memory=1.0, network=1.0)
# A CPU-like profile whose linears and prefill attention follow measured curves
# (and whose memory is fast enough that every op is compute bound).
CURVED_HW = replace(
    UNIT_HW,
    mem_bandwidth=1e18,
    efficiency_curves={"gemm": [[1, 0.05], [64, 0.6], [1024, 0.9]], "attention": [[64, 0.3], [1024, 0.7]]},
)
# An 8-token prefill from position 0 (which completes its prompt) and two
# decodes at positions 10 and 20: all three sample.
BATCH = BatchShape.from_chunks([(0, 8), (10, 1), (20, 1)], num_sampled=3)


def ops_by_name(cm: CostModel, batch: BatchShape) -> dict:
    return {op.name: op for op in cm.ops(batch)}


def test_batch_shape_sums():
    assert BATCH.num_tokens == 10
    assert BATCH.prefill_tokens == 8
    assert BATCH.prefill_pairs == 8 * 9 // 2
    assert BATCH.prefill_context == 0
    assert (BATCH.num_decodes, BATCH.decode_context) == (2, 11 + 21)
    chunk = BatchShape.from_chunks([(100, 4)], 0)
    # Queries at positions 100..103 see 101..104 keys.
    assert chunk.prefill_pairs == 101 + 102 + 103 + 104
    assert chunk.prefill_context == 100


def test_tiny_model_matches_hand_computation():
    cm = CostModel(TINY, UNIT_HW, efficiency=PERFECT, step_overhead_s=0.0)
    ops = ops_by_name(cm, BATCH)
    # Attention projections per layer: qkv 64 x (64 + 2*2*16) + o 64 x 64 = 12288; two layers.
    lin = ops["attention_linears"]
    assert lin.flops == 2 * 10 * 24576
    # Weights once (2 bytes each) + per token the projections' inputs and outputs:
    # per layer (64 + 128) + (64 + 64) = 320 elements, 2 layers, 2 bytes.
    assert lin.bytes == 24576 * 2 + 10 * 320 * 2 * 2
    # Prefill: 36 causal pairs x 2 layers x 4 (QK and PV) x 4 heads x 16 dims.
    pre = ops["attention_prefill"]
    assert pre.flops == 36 * 2 * 4 * 4 * 16
    # KV per token: 2 layers x 2 (K, V) x 2 heads x 16 x 2 bytes = 256; the chunk's
    # KV written and read back, plus q and o (2 layers x 2 x 64 x 2 bytes) per token.
    assert pre.bytes == 2 * 8 * 256 + 8 * 512
    dec = ops["attention_decode"]
    assert dec.flops == 32 * 2 * 4 * 4 * 16
    assert dec.bytes == (32 + 2) * 256 + 2 * 512
    mlp = ops["mlp"]
    assert mlp.flops == 2 * 10 * (2 * 3 * 64 * 128)
    assert mlp.bytes == 2 * 3 * 64 * 128 * 2 + 10 * 2 * (2 * 64 + 3 * 128) * 2
    head = ops["lm_head"]
    assert head.flops == 2 * 3 * 1000 * 64
    assert head.bytes == 1000 * 64 * 2 + 3 * 1000 * 4
    for op in cm.ops(BATCH):
        expected = max(op.flops / 1e12, op.bytes / 1e9)
        assert op.seconds == pytest.approx(expected), op.name
        assert op.bound == ("compute" if op.flops / 1e12 > op.bytes / 1e9 else "memory")
    assert cm.step_time(BATCH) == pytest.approx(sum(op.seconds for op in cm.ops(BATCH)))


def test_only_sampling_requests_pay_for_the_lm_head():
    cm = CostModel(TINY, UNIT_HW, efficiency=PERFECT, step_overhead_s=0.0)
    partial = BatchShape.from_chunks([(0, 8)], num_sampled=0)
    assert "lm_head" not in ops_by_name(cm, partial)
    assert "sampler" not in ops_by_name(cm, partial)
    one = ops_by_name(cm, BatchShape.from_chunks([(0, 8)], num_sampled=1))["lm_head"]
    three = ops_by_name(cm, BatchShape.from_chunks([(0, 8)], num_sampled=3))["lm_head"]
    assert three.flops == 3 * one.flops


def test_efficiencies_and_overhead_scale_time():
    base = CostModel(TINY, UNIT_HW, efficiency=PERFECT, step_overhead_s=0.0)
    half_mem = CostModel(TINY, UNIT_HW, efficiency=Efficiency(1.0, 1.0, 0.5, 1.0), step_overhead_s=0.0)
    # The tiny model on this hardware is memory bound everywhere: half the bandwidth, twice the time.
    assert all(op.bound == "memory" for op in base.ops(BATCH))
    assert half_mem.step_time(BATCH) == pytest.approx(2 * base.step_time(BATCH))
    slow = CostModel(TINY, UNIT_HW, efficiency=PERFECT, step_overhead_s=0.25)
    assert slow.step_time(BATCH) == pytest.approx(base.step_time(BATCH) + 0.25)
    assert slow.step_time(BatchShape()) == 0.0


def test_decode_step_is_bandwidth_bound_and_big_prefill_compute_bound_on_h100():
    cm = CostModel(load_model("llama-3-8b"), load_hardware("h100"))
    decode = BatchShape.from_chunks([(1000, 1)] * 64, num_sampled=64)
    kernels = [op for op in cm.ops(decode) if op.bound != "overhead"]
    assert kernels and all(op.bound == "memory" for op in kernels)
    prefill = BatchShape.from_chunks([(0, 8192)], num_sampled=1)
    ops = ops_by_name(cm, prefill)
    for name in ("attention_linears", "mlp", "attention_prefill"):
        assert ops[name].bound == "compute", name
    compute = sum(op.seconds for op in ops.values() if op.bound == "compute")
    assert compute > 0.8 * cm.step_time(prefill)
    # Decoding one token reads all weights: ~16 GB at ~80% of 3.35 TB/s, plus overhead.
    one = cm.step_time(BatchShape.from_chunks([(100, 1)], 1))
    assert 5e-3 < one < 8e-3


def test_tensor_parallelism_halves_weight_traffic_and_adds_all_reduces():
    m = load_model("llama-3-8b")
    hw = load_hardware("h100")
    b = BatchShape.from_chunks([(100, 1)], 1)
    one = ops_by_name(CostModel(m, hw, Parallelism(1)), b)
    two = ops_by_name(CostModel(m, hw, Parallelism(2)), b)
    for name in ("attention_linears", "mlp", "lm_head"):
        assert two[name].bytes == pytest.approx(one[name].bytes / 2, rel=1e-3), name
        assert two[name].flops == pytest.approx(one[name].flops / 2), name
    assert "tp_all_reduce" not in one
    ar = two["tp_all_reduce"]
    n = 2 * m.num_layers + 1
    msg = 1 * m.hidden_size * m.dtype_bytes
    # Ring all-reduce: each GPU moves 2(tp-1)/tp of the message; plus a latency per collective.
    assert ar.comm_bytes == pytest.approx(n * msg)
    assert ar.seconds == pytest.approx(n * hw.collective_latency_s + n * msg / (hw.link_bandwidth * 0.7))
    assert ar.bound == "network"


def test_moe_touched_experts():
    m = load_model("qwen3-30b-a3b")  # 128 experts, top-8, 48 MoE layers
    hw = load_hardware("h100")
    expert_bytes = m.expert_params() * m.weight_bytes
    L = m.num_moe_layers

    def experts(par: Parallelism, tokens: int):
        cm = CostModel(m, hw, par)
        return ops_by_name(cm, BatchShape.from_chunks([(100, 1)] * tokens, tokens))["moe_experts"]

    def weight_part(op, tokens: int, io_per_assignment: float) -> float:
        return op.bytes / L - tokens * m.num_experts_per_tok * io_per_assignment

    io1 = (2 * m.hidden_size + 3 * m.moe_intermediate_size) * m.dtype_bytes
    # min(num_experts, tokens x top_k) experts are read: 8, 32, then all 128.
    for tokens, touched in ((1, 8), (4, 32), (16, 128), (64, 128)):
        op = experts(Parallelism(1), tokens)
        assert weight_part(op, tokens, io1) == pytest.approx(touched * expert_bytes), tokens
        assert op.flops == pytest.approx(L * 2 * tokens * 8 * m.expert_params())
    # TP=4 without EP: every GPU holds a quarter of every expert.
    io4 = (2 * m.hidden_size + 3 * m.moe_intermediate_size / 4) * m.dtype_bytes
    op = experts(Parallelism(4), 1)
    assert weight_part(op, 1, io4) == pytest.approx(8 * expert_bytes / 4)
    # EP=4: a GPU holds 32 whole experts; at most min(32, tokens x top_k) are read.
    for tokens, touched in ((1, 8), (2, 16), (16, 32)):
        op = experts(Parallelism(4, enable_expert_parallel=True), tokens)
        io_ep = tokens * 8 / 4 * (2 * m.hidden_size + 3 * m.moe_intermediate_size) * m.dtype_bytes
        assert op.bytes / L - io_ep == pytest.approx(touched * expert_bytes), tokens
        assert op.flops == pytest.approx(L * 2 * tokens * 8 / 4 * m.expert_params())


def test_expert_parallelism_uses_all_to_all():
    m = load_model("deepseek-v3")
    hw = load_hardware("h200")
    b = BatchShape.from_chunks([(100, 1)] * 32, 32)
    tp = ops_by_name(CostModel(m, hw, Parallelism(8)), b)
    ep = ops_by_name(CostModel(m, hw, Parallelism(8, enable_expert_parallel=True)), b)
    assert "ep_all_to_all" not in tp
    a2a = ep["ep_all_to_all"]
    T, k, h, a = 32, 8, m.hidden_size, m.dtype_bytes
    per_layer = 2 * (T / 8) * k * h * a * 7 / 8 + T * h * a * 7 / 8
    assert a2a.comm_bytes == pytest.approx(m.num_moe_layers * per_layer)
    # MoE layers drop their MLP all-reduce under EP.
    ring = 2 * 7 / 8 * T * h * a
    assert tp["tp_all_reduce"].comm_bytes == pytest.approx((2 * 61 + 1) * ring)
    assert ep["tp_all_reduce"].comm_bytes == pytest.approx((2 * 61 + 1 - 58) * ring)
    assert "moe_shared_experts" in ep and "moe_router" in ep


def test_mla_decode_reads_the_compressed_latent():
    m = load_model("deepseek-v3")
    cm = CostModel(m, load_hardware("h200"), Parallelism(8))
    dec = ops_by_name(cm, BatchShape.from_chunks([(999, 1)], 1))["attention_decode"]
    latent = m.num_layers * 576 * 2
    assert dec.bytes == pytest.approx((1000 + 1) * latent + 1 * cm.qo_token_bytes)
    assert dec.flops == pytest.approx(1000 * m.num_layers * 2 * 16 * (2 * 512 + 64))


def test_kv_cache_dtype_halves_attention_bytes():
    m = load_model("llama-3-8b")
    # A profile without a kernel fit: the fit's decode floor counts as bytes-equivalents.
    hw = load_hardware("h100-roofline")
    b = BatchShape.from_chunks([(4000, 1)] * 8, 8)
    bf16 = ops_by_name(CostModel(m, hw), b)["attention_decode"]
    fp8 = ops_by_name(CostModel(m, hw, kv_cache_dtype_bytes=1.0), b)["attention_decode"]
    assert fp8.bytes < 0.52 * bf16.bytes


def test_constant_cost_model():
    assert ConstantCostModel(0.25).step_time(BATCH) == 0.25


def test_efficiency_parse():
    e = Efficiency.parse("gemm=0.6, memory=0.75")
    assert (e.gemm, e.memory, e.attention, e.network) == (0.6, 0.75, 0.5, 0.7)
    assert Efficiency.parse(["gemm=0.5", "network=0.9"]).network == 0.9
    assert Efficiency.parse(None) == Efficiency()
    for bad in ("speed=1", "gemm", "gemm=fast", "gemm=1.5", "memory=0"):
        with pytest.raises(ConfigError):
            Efficiency.parse(bad)


def test_describe_names_the_setup():
    cm = CostModel(load_model("qwen3-32b"), load_hardware("h100"), Parallelism(8))
    assert "qwen3-32b on 8x h100" in cm.describe() and "TP=8" in cm.describe()


# ---- kernel launches: CUDA graphs, piecewise graphs, eager ---------------------------

# One millisecond per launch keeps the launch terms round. TINY in bf16 on one GPU
# launches per layer: attention 6 (add+RMSNorm, QKV GEMM, rotary, KV-cache write,
# attention, O GEMM) and MLP 4 (add+RMSNorm, gate_up GEMM, SiLU-and-mul, down GEMM):
# 2 layers x 10 = 20 eagerly. Piecewise: per layer the attention core (cache write,
# attention) and one graph replay: 2 x 3 = 6.
LAUNCH_HW = replace(UNIT_HW, kernel_launch_s=1e-3)
DECODES = BatchShape.from_chunks([(10, 1), (20, 1)], num_sampled=2)


def launch_model(cap: int) -> CostModel:
    return CostModel(TINY, LAUNCH_HW, efficiency=PERFECT, step_overhead_s=0.0, cuda_graph_max_tokens=cap)


def kernels_only(cm: CostModel, batch: BatchShape) -> float:
    return sum(op.seconds for op in cm.ops(batch) if op.bound != "overhead")


def test_a_decode_step_within_the_capture_size_pays_no_launches():
    cm = launch_model(512)
    assert (cm.eager_launches, cm.piecewise_launches) == (20, 6)
    assert cm.launch_mode(DECODES) == LAUNCH_GRAPH
    assert {op.name for op in cm.ops(DECODES)}.isdisjoint({"eager_launches", "piecewise_launches"})
    assert cm.step_time(DECODES) == pytest.approx(kernels_only(cm, DECODES))
    # Exactly at the capture size still replays the graph.
    assert launch_model(2).launch_mode(DECODES) == LAUNCH_GRAPH


def test_a_decode_step_beyond_the_capture_size_or_without_graphs_launches_every_kernel():
    for cap in (1, 0):
        cm = launch_model(cap)
        assert cm.launch_mode(DECODES) == LAUNCH_EAGER
        assert ops_by_name(cm, DECODES)["eager_launches"].seconds == pytest.approx(20e-3)
        assert cm.step_time(DECODES) == pytest.approx(kernels_only(cm, DECODES) + 20e-3)


def test_a_mixed_step_runs_piecewise_within_the_capture_size_and_eagerly_beyond_it():
    # BATCH: an 8-token prefill and two decodes, 10 tokens.
    within = launch_model(10)
    assert within.launch_mode(BATCH) == LAUNCH_PIECEWISE
    assert ops_by_name(within, BATCH)["piecewise_launches"].bound == "overhead"
    assert within.step_time(BATCH) == pytest.approx(kernels_only(within, BATCH) + 6e-3)
    beyond = launch_model(9)
    assert beyond.launch_mode(BATCH) == LAUNCH_EAGER
    assert beyond.step_time(BATCH) == pytest.approx(kernels_only(beyond, BATCH) + 20e-3)
    # A mode the data-parallel group agreed on overrides the batch's own.
    assert within.step_time_in_group(BATCH, 10, LAUNCH_EAGER) == pytest.approx(beyond.step_time(BATCH))
    assert within.step_time_in_group(DECODES, 2, LAUNCH_EAGER) == pytest.approx(
        within.step_time(DECODES) + 20e-3
    )


def test_kernels_launched_per_layer_follow_the_architecture():
    h100 = load_hardware("h100")
    llama = load_model("llama-3-8b")
    assert CostModel(llama, h100).eager_launches == 32 * 10
    # TP 2: an all-reduce after attention and after the MLP.
    assert CostModel(llama, h100, Parallelism(2)).eager_launches == 32 * 12
    # Qwen3-30B-A3B, bf16, one GPU, 48 MoE layers: attention 6; MoE MLP: add+RMSNorm,
    # router, top-k (2), routed experts (quantise, permute, 2 grouped GEMMs,
    # activation, unpermute: 6), add = 11; no shared expert, no all-reduce.
    assert CostModel(load_model("qwen3-30b-a3b"), h100).eager_launches == 48 * 17
    # DeepSeek-V3, fp8 (two launches per linear), TP 4 inside DP 4 (EP 16).
    # Attention: add+RMSNorm 1, fused q_a/kv_a, q_b and O linears 6, latent norms 2,
    # rotary 1, all-reduce 1, core 9 (cache write, absorption BMM, FlashMLA, value
    # BMM, kv_b linear 2, FlashAttention, merge) = 20. Dense MLP: 1 + 4 + 1 + 1 = 7.
    # MoE: 1 + router 1 + top-k 2 + shared expert 5 + routed 6 + dispatch layout,
    # dispatch, combine 3 + add 1 = 19.
    dsv3 = CostModel(load_model("deepseek-v3"), h100, Parallelism(4, True, 4))
    assert dsv3.eager_launches == 61 * 20 + 3 * 7 + 58 * 19 == 2343
    assert dsv3.piecewise_launches == 61 * (9 + 1)
    assert dsv3.eager_launch_s == pytest.approx(2343 * 5e-6)


def test_launch_parameters_override_the_counts_and_the_hardware():
    h100 = load_hardware("h100")
    llama = load_model("llama-3-8b")
    assert CostModel(llama, h100).launch_latency_s == h100.kernel_launch_s == 5e-6
    cm = CostModel(llama, h100, launch_latency_s=15e-6, kernels_per_layer=40)
    assert cm.eager_launches == 32 * 40
    assert cm.eager_launch_s == pytest.approx(32 * 40 * 15e-6)
    # The piecewise count stays the attention core's.
    assert cm.piecewise_launches == 32 * 3
    assert CostModel(TINY, UNIT_HW).eager_launch_s == 0.0  # a profile without launch costs
    assert "CUDA graphs up to 512 tokens" in cm.describe()
    assert "no CUDA graphs" in CostModel(llama, h100, cuda_graph_max_tokens=0).describe()
    for kwargs in (
        {"cuda_graph_max_tokens": -1},
        {"cuda_graph_max_tokens": "64"},
        {"cuda_graph_max_tokens": True},
        {"launch_latency_s": -1e-6},
        {"kernels_per_layer": -3},
    ):
        with pytest.raises(ConfigError):
            CostModel(llama, h100, **kwargs)


def test_expert_exchanges_pay_the_same_fixed_latency_in_decode_and_prefill_steps():
    # DeepEP publishes no fixed latency per mode (low-latency for decode, normal for
    # prefill), so both kinds of step pay the collective latency per exchange.
    m = load_model("deepseek-v3")
    hw = load_hardware("h100")
    cm = CostModel(m, hw, Parallelism(4, True, 4))
    decode = BatchShape.from_chunks([(2000, 1)] * 32, 32)
    prefill = BatchShape.from_chunks([(0, 4096)], 1)
    for batch, group in ((decode, 128), (prefill, 4096 + 96)):
        a2a = ops_by_name_in_group(cm, batch, group)["ep_all_to_all"]
        fixed = a2a.seconds - a2a.comm_bytes / (hw.link_bandwidth * cm.efficiency.network)
        assert fixed == pytest.approx(3 * m.num_moe_layers * hw.collective_latency_s)


def ops_by_name_in_group(cm: CostModel, batch: BatchShape, group: int) -> dict:
    return {op.name: op for op in cm.ops(batch, group)}


def test_host_costs_of_the_hardware_are_charged_per_step_layer_and_request():
    hw = replace(UNIT_HW, step_overhead_s=0.003, layer_overhead_s=0.01, request_overhead_s=0.002)
    cm = CostModel(TINY, hw, efficiency=PERFECT)
    ops = ops_by_name(cm, BATCH)
    assert BATCH.num_prefills == 1
    assert ops["step_overhead"].seconds == 0.003
    assert ops["layer_overhead"].seconds == pytest.approx(2 * 0.01)
    # One prefill chunk and two decodes.
    assert ops["request_overhead"].seconds == pytest.approx(3 * 0.002)
    # An explicit step overhead wins over the hardware's; without either, 0.5 ms.
    assert ops_by_name(CostModel(TINY, hw, step_overhead_s=0.0), BATCH).get("step_overhead") is None
    assert CostModel(TINY, UNIT_HW).step_overhead_s == 5e-4
    assert "request_overhead" not in ops_by_name(CostModel(TINY, UNIT_HW), BATCH)


def test_layer_host_time_covers_the_weight_gemms_of_small_steps_only():
    hw = replace(UNIT_HW, layer_overhead_s=0.5, layer_overhead_covers_tokens=4)
    cm = CostModel(TINY, hw, efficiency=PERFECT)
    full = CostModel(TINY, replace(hw, layer_overhead_covers_tokens=0), efficiency=PERFECT)
    gemms = ("attention_linears", "mlp", "lm_head")
    for batch, covered in ((BatchShape.from_chunks([(10, 1), (20, 1)], num_sampled=2), True), (BATCH, False)):
        ops, ref = ops_by_name(cm, batch), ops_by_name(full, batch)
        assert ref["layer_overhead"].seconds == pytest.approx(2 * 0.5)
        if covered:
            # Two decodes: only what the GEMMs leave of the layers' host time is charged.
            left = 2 * 0.5 - sum(ops[g].seconds for g in gemms)
            assert 0 < left < 1.0
            assert ops["layer_overhead"].seconds == pytest.approx(left)
        else:
            # Ten tokens, beyond the covered four: charged in full.
            assert ops["layer_overhead"].seconds == ref["layer_overhead"].seconds
    # GEMMs longer than the layers' host time leave none of it.
    slow = CostModel(TINY, replace(hw, mem_bandwidth=1e5), efficiency=PERFECT)
    one = BatchShape.from_chunks([(10, 1)], num_sampled=1)
    assert ops_by_name(slow, one)["layer_overhead"].seconds == 0.0


def test_cpu_like_step_parts_and_decode_runs_equal_the_op_by_op_sums():
    from array import array

    from llmsched.executor.sim.cost_model import decode_run_of

    hw = replace(
        load_hardware("h100"), layer_overhead_s=2e-4, layer_overhead_covers_tokens=32, cuda_graphs=False
    )
    cm = CostModel(load_model("llama-3-8b"), hw)
    for d in (1, 8, 32, 33, 64):
        batch = BatchShape.from_chunks([(100 + i, 1) for i in range(d)], num_sampled=d)
        assert cm.step_time(batch) == sum(op.seconds for op in cm.ops(batch))
        ends, totals, hosts, models = array("d"), array("d"), array("d"), array("d")
        decode_run_of(cm, d)(batch.decode_context - d, 0.0, 1e9, 1, ends, totals, hosts, models)
        assert totals[0] == pytest.approx(cm.step_time(batch), rel=1e-12)


@pytest.mark.parametrize(
    ("model", "hw", "tp", "ep"),
    [
        ("llama-3-8b", "h100", 1, False),
        ("qwen3-32b", "h100", 2, False),
        ("deepseek-v3", "h100", 8, True),
        ("llama-3-8b", "cpu-like, with efficiency curves", 1, False),
    ],
)
def test_step_parts_by_shape_equal_the_op_by_op_sums_bit_for_bit(model, hw, tp, ep):
    host = {"layer_overhead_s": 1e-4, "layer_overhead_covers_tokens": 32, "cuda_graphs": False}
    cm = CostModel(
        load_model(model),
        replace(CURVED_HW, mem_bandwidth=1e9, **host) if hw.startswith("cpu") else load_hardware(hw),
        Parallelism(tensor_parallel_size=tp, enable_expert_parallel=ep),
        cuda_graph_max_tokens=64,
    )
    rng = random.Random(5)
    for _ in range(400):
        chunks = [(rng.randrange(0, 4000), 1) for _ in range(rng.randrange(0, 40))]
        chunks += [(rng.randrange(0, 2000), rng.randrange(2, 900)) for _ in range(rng.randrange(0, 3))]
        if not chunks:
            continue
        batch = BatchShape.from_chunks(chunks, num_sampled=rng.randrange(0, len(chunks) + 1))
        t = host = dev = 0.0
        for op in cm.ops(batch):
            t += op.seconds
            if op.name in HOST_OPS:
                host += op.seconds
            else:
                dev += op.seconds
        # Twice: the second call is served from the per-shape figures.
        assert cm.step_parts(batch) == (t, host, dev) == cm.step_parts(batch)
        assert cm.step_time(batch) == t


@pytest.mark.parametrize("unrolled", [True, False])
@pytest.mark.parametrize("model", ["llama-3-8b", "bamba-9b"])
@pytest.mark.parametrize("d", [1, 3, 64, 300])
# Contexts a request inside one piece of the fit's KV rate, and crossing its 1024- and 4096-token knots.
@pytest.mark.parametrize("per_request", [700, 1010, 4080])
def test_decode_run_clocks_decode_step_parts_bit_for_bit(model, d, per_request, unrolled, monkeypatch):
    from array import array

    from llmsched.executor.sim import cost_model as cost_model_module

    if not unrolled:
        # Every tail longer than the unrolled sum takes: the looped clock.
        monkeypatch.setattr(cost_model_module, "_UNROLLED", 0)

    from llmsched.executor.sim.cost_model import decode_run_of

    cm = CostModel(load_model(model), load_hardware("h100"))
    models = [cm, ConstantCostModel(0.004, host_seconds=0.001)]
    for cost in models:
        runs = []
        for run in (decode_run_of(cost, d), _stepped_run(cost, d)):
            ends, totals, hosts, mods = array("d"), array("d"), array("d"), array("d")
            last = run(d * per_request, 1.25, 1.25 + 0.5, 40, ends, totals, hosts, mods)
            runs.append((last, list(ends), list(totals), list(hosts), list(mods)))
        assert runs[0] == runs[1]
        (n, start, end, ctx), ends, totals, hosts, mods = runs[0]
        assert 0 < n <= 40 and end == ends[-1] and ctx == d * (per_request + n)
        # Each step priced exactly as execute() prices its batch.
        for j in range(n):
            batch = BatchShape(d, d, 0, 0, 0, d, d * (per_request + 1 + j), 0)
            assert cost.step_parts(batch) == (totals[j], hosts[j], mods[j])
        # Each step starts before the limit; a shorter run stopped at it.
        assert start < 1.75 and (n == 40 or end >= 1.75)
        # No step asked for, or none starting before the limit: nothing clocked.
        for num_steps, until in ((0, 9.0), (5, 1.25), (5, 1.0), (1, 1.2500001)):
            got = []
            for run in (decode_run_of(cost, d), _stepped_run(cost, d)):
                ends, totals, hosts, mods = array("d"), array("d"), array("d"), array("d")
                last = run(d * per_request, 1.25, until, num_steps, ends, totals, hosts, mods)
                got.append((last, list(ends), list(totals), list(hosts), list(mods)))
            assert got[0] == got[1]
            assert got[0][0][0] == (1 if until > 1.25 and num_steps else 0)


def _stepped_run(cost, d):
    """decode_run's contract, one decode_step_parts call per step: decode_run_of's generic clock."""
    from llmsched.executor.sim.cost_model import decode_run_of, decode_step_parts_of

    class Stepped:
        """``cost``'s step prices without its own decode_run."""

        def decode_step_parts(self, num_decodes):
            return decode_step_parts_of(cost, num_decodes)

    return decode_run_of(Stepped(), d)


def test_a_gemm_curve_prices_linears_without_a_separate_memory_bound():
    eff = Efficiency(gemm=0.6, attention=0.4, memory=0.5)
    flat = replace(UNIT_HW, efficiency_curves={"gemm": [[1, 0.6]], "attention": [[1, 0.4]]})
    a, b = CostModel(TINY, UNIT_HW, efficiency=eff), CostModel(TINY, flat, efficiency=eff)
    linears = ("attention_linears", "mlp", "lm_head")
    for batch in (BATCH, DECODES, BatchShape.from_chunks([(0, 300)], num_sampled=1)):
        plain, curved = ops_by_name(a, batch), ops_by_name(b, batch)
        # The curve was timed on weights beyond the caches: it is the linears' whole time.
        for name in linears:
            assert curved[name].seconds == curved[name].flops / (0.6 * UNIT_HW.peak_flops_bf16)
        # A flat attention curve is the constant, and every other op is priced as before.
        others = [n for n in plain if n not in linears]
        assert [plain[n].seconds for n in others] == [curved[n].seconds for n in others]
    # On this slow memory the roofline without the curve is weight bound.
    d = ops_by_name(a, DECODES)["mlp"]
    assert d.seconds == d.bytes / (0.5 * UNIT_HW.mem_bandwidth) > ops_by_name(b, DECODES)["mlp"].seconds


def test_linears_follow_the_gemm_curve_by_the_steps_rows():
    cm = CostModel(TINY, CURVED_HW, efficiency=PERFECT)
    peak = CURVED_HW.peak_flops_bf16
    for rows, eff in ((1, 0.05), (8, 0.05 + (0.6 - 0.05) * 3 / 6), (64, 0.6), (256, 0.75), (4096, 0.9)):
        batch = BatchShape.from_chunks([(0, rows)], num_sampled=1)
        mlp = ops_by_name(cm, batch)["mlp"]
        assert mlp.seconds == pytest.approx(mlp.flops / (peak * eff), rel=1e-12)
    # The LM head runs one row per sampled request, not the step's rows.
    head = ops_by_name(cm, BatchShape.from_chunks([(0, 1024)], num_sampled=1))["lm_head"]
    assert head.seconds == pytest.approx(head.flops / (peak * 0.05), rel=1e-12)


def test_prefill_attention_follows_the_curve_by_keys_per_query():
    cm = CostModel(TINY, CURVED_HW, efficiency=PERFECT)
    fast = replace(CURVED_HW, efficiency_curves={"gemm": [[1, 0.5]], "attention": [[1, 0.7]]})
    ref = CostModel(TINY, fast, efficiency=PERFECT)
    # A 127-token prompt: 64 keys per query on average, the curve's low end (0.3 against 0.7).
    short = BatchShape.from_chunks([(0, 127)], num_sampled=1)
    a, b = ops_by_name(cm, short)["attention_prefill"], ops_by_name(ref, short)["attention_prefill"]
    assert a.seconds == pytest.approx(b.seconds * 0.7 / 0.3, rel=1e-9)
    # A 256-token chunk after 1900 cached tokens reads over 1024 keys per query: the high end.
    late = BatchShape.from_chunks([(1900, 256)], num_sampled=1)
    a, b = ops_by_name(cm, late)["attention_prefill"], ops_by_name(ref, late)["attention_prefill"]
    assert a.seconds == b.seconds
