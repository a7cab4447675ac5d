"""Deployments: vLLM's defaults per hardware, and engine arguments resolved and checked."""

from __future__ import annotations

import json

import pytest

from llmsched.core.errors import ConfigError
from llmsched.sim.deployment import DeploymentSpec, build_deployment, resolve_hash_algo


def build(**kw) -> object:
    return build_deployment(DeploymentSpec(**kw))


@pytest.mark.parametrize(
    ("hardware", "model", "budget", "seqs"),
    [
        ("h100", "llama-3-8b", 8192, 1024),
        ("h200", "llama-3-8b", 8192, 1024),
        ("b200", "llama-3-8b", 16384, 1024),
    ],
)
def test_vllm_serving_defaults_by_hardware(hardware, model, budget, seqs):
    c = build(hardware=hardware, model=model).scheduler_config
    assert (c.max_num_batched_tokens, c.max_num_seqs) == (budget, seqs)
    assert c.max_model_len == 8192 and c.block_size == 16
    assert c.enable_prefix_caching and c.enable_chunked_prefill and c.policy == "fcfs"


def test_a100_defaults_are_smaller():
    c = build(hardware="a100", model="qwen3-0.6b").scheduler_config
    assert (c.max_num_batched_tokens, c.max_num_seqs) == (2048, 256)


def test_unchunked_prefill_budget_covers_max_model_len():
    c = build(enable_chunked_prefill=False).scheduler_config
    assert c.max_num_batched_tokens == 8192 == c.max_model_len
    c = build(enable_chunked_prefill=False, model="qwen3-0.6b", max_model_len=16384).scheduler_config
    assert c.max_num_batched_tokens == 16384


def test_engine_arguments_pass_through():
    d = build(
        max_num_batched_tokens=4096,
        max_num_seqs=64,
        block_size=32,
        enable_prefix_caching=False,
        long_prefill_token_threshold=512,
        scheduling_policy="priority",
        max_model_len=4096,
        num_gpu_blocks=2000,
    )
    c = d.scheduler_config
    assert (c.max_num_batched_tokens, c.max_num_seqs, c.block_size, c.max_model_len) == (4096, 64, 32, 4096)
    assert not c.enable_prefix_caching and c.long_prefill_token_threshold == 512 and c.policy == "priority"
    assert c.num_gpu_blocks == 2000 == d.memory.num_gpu_blocks


def test_fp8_weights_and_kv_cache():
    base = build()
    fp8 = build(quantization="fp8")
    # Linear layers drop to one byte per weight; embeddings and LM head stay bf16.
    m = base.model
    linear = m.layer_linear_params()
    assert fp8.memory.weight_bytes == pytest.approx(linear + 2 * (m.num_params() - linear))
    assert fp8.memory.num_gpu_blocks > base.memory.num_gpu_blocks
    kv8 = build(kv_cache_dtype="fp8")
    assert kv8.memory.kv_bytes_per_token == base.memory.kv_bytes_per_token / 2
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        build(kv_cache_dtype="int3")
    with pytest.raises(ConfigError, match="quantization"):
        build(quantization="awq")


def test_parallelism_checks(tmp_path):
    with pytest.raises(ConfigError, match="must divide the number of attention heads"):
        build(tensor_parallel_size=3)
    d = build(model="deepseek-v3", hardware="h200", tensor_parallel_size=8, enable_expert_parallel=True)
    assert d.cost_model.ep == 8
    assert "EP" in d.describe()[1]

    cfg = {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    build(model=str(path), tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ConfigError, match=r"num_experts \(6\) divisible"):
        build(model=str(path), tensor_parallel_size=4, enable_expert_parallel=True)


def test_hash_algo_resolution():
    assert resolve_hash_algo("sha256") == "sha256"
    assert resolve_hash_algo("auto") in ("xxh3_128", "sha256")
    assert build(prefix_caching_hash_algo="blake2b").scheduler_config.prefix_caching_hash_algo == "blake2b"


def test_describe_and_json():
    d = build(model="qwen3-32b", tensor_parallel_size=8, max_model_len=16384)
    text = "\n".join(d.describe())
    assert "qwen3-32b" in text and "8x NVIDIA H100" in text and "max_model_len 16384" in text
    data = json.loads(json.dumps(d.to_dict()))
    assert data["tensor_parallel_size"] == 8
    assert data["memory"]["num_gpu_blocks"] == d.scheduler_config.num_gpu_blocks
    assert data["efficiency"]["gemm"] == 0.7


def test_cuda_graph_capture_size_follows_vllm_and_launch_costs_pass_through(tmp_path):
    # vLLM's default max_cudagraph_capture_size: 2 x max_num_seqs, at most 512, at most the budget.
    assert build().cost_model.cuda_graph_max_tokens == 512
    assert build(max_num_seqs=32).cost_model.cuda_graph_max_tokens == 64
    assert build(max_num_seqs=200, max_num_batched_tokens=256).cost_model.cuda_graph_max_tokens == 256
    assert build(cuda_graph_max_tokens=0).cost_model.cuda_graph_max_tokens == 0
    d = build(launch_latency_us=12.5, kernels_per_layer=20)
    cm = d.cost_model
    assert cm.launch_latency_s == pytest.approx(12.5e-6)
    assert cm.eager_launches == 32 * 20
    launch = json.loads(json.dumps(d.to_dict()))["launch"]
    assert launch["cuda_graph_max_tokens"] == 512 and launch["launch_latency_us"] == pytest.approx(12.5)
    assert launch["eager_step_extra_ms"] == pytest.approx(32 * 20 * 12.5e-3)
    assert "CUDA graphs up to 512 tokens, 12.5 us per launch" in d.describe()[-1]
    # The hardware profile's figure by default: 5 us on the built-in GPUs, 0 where a
    # JSON profile does not say.
    assert build().cost_model.launch_latency_s == 5e-6
    gpu = tmp_path / "gpu.json"
    gpu.write_text(
        json.dumps(
            {
                "peak_flops_bf16": 1e15,
                "mem_bandwidth": 3e12,
                "mem_capacity": 80 * 2**30,
                "link_bandwidth": 4e11,
                "collective_latency_s": 1e-5,
            }
        )
    )
    assert build(hardware=str(gpu)).cost_model.eager_launch_s == 0.0
    with pytest.raises(ConfigError, match="launch_latency_us=-1"):
        build(launch_latency_us=-1.0)
    with pytest.raises(ConfigError, match="cuda_graph_max_tokens=-4"):
        build(cuda_graph_max_tokens=-4)


def test_defaults_follow_the_entry_point_and_cpu_rule():
    c = build(hardware="h100", usage_context="LLM_CLASS").scheduler_config
    assert (c.max_num_batched_tokens, c.max_num_seqs) == (16384, 1024)
    c = build(hardware="a100", model="qwen3-0.6b", usage_context="LLM_CLASS").scheduler_config
    assert (c.max_num_batched_tokens, c.max_num_seqs) == (8192, 256)
    with pytest.raises(ConfigError, match="usage_context"):
        build(usage_context="nope")
