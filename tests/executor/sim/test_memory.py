"""KV cache sizing from GPU memory, and configurations that cannot start."""

from __future__ import annotations

import pytest

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.hardware import GiB, load_hardware
from llmsched.executor.sim.memory import RUNTIME_RESERVE_BYTES, plan_memory, weight_bytes_per_gpu
from llmsched.executor.sim.model_shapes import load_model

LLAMA8 = load_model("llama-3-8b")
H100 = load_hardware("h100")


def test_blocks_fill_the_memory_left_after_weights():
    p = plan_memory(LLAMA8, H100, max_num_batched_tokens=8192, max_num_seqs=256)
    assert p.weight_bytes == pytest.approx(LLAMA8.weight_bytes_total())
    assert p.kv_bytes_per_token == 128 * 1024
    left = 0.9 * H100.mem_capacity - p.weight_bytes - p.activation_bytes - RUNTIME_RESERVE_BYTES
    assert p.num_gpu_blocks == int(left // (16 * 128 * 1024))
    # vLLM reports ~450k tokens for this deployment.
    assert 400_000 < p.kv_cache_tokens < 480_000
    assert p.max_model_len == 8192
    assert p.max_concurrency == pytest.approx(p.kv_cache_tokens / 8192)


def test_more_memory_more_blocks():
    base = plan_memory(LLAMA8, H100).num_gpu_blocks
    assert plan_memory(LLAMA8, H100, gpu_memory_utilization=0.95).num_gpu_blocks > base
    assert plan_memory(LLAMA8, load_hardware("h200")).num_gpu_blocks > base
    assert plan_memory(LLAMA8, H100, kv_cache_dtype_bytes=1.0).num_gpu_blocks == pytest.approx(
        2 * base, rel=0.01
    )
    # TP=2 halves weights and KV per token on each GPU: more than twice the tokens.
    assert (
        plan_memory(LLAMA8, H100, tensor_parallel_size=2).kv_cache_tokens
        > 2 * plan_memory(LLAMA8, H100).kv_cache_tokens
    )


def test_tensor_parallel_weights():
    assert weight_bytes_per_gpu(LLAMA8, 2) == pytest.approx(LLAMA8.weight_bytes_total() / 2, rel=1e-3)
    ds = load_model("deepseek-v3")
    # MLA down-projections, norms and routers are replicated: a bit more than 1/8.
    assert weight_bytes_per_gpu(ds, 8) > ds.weight_bytes_total() / 8


def test_override_is_used_as_given():
    p = plan_memory(LLAMA8, H100, num_gpu_blocks=1000, max_model_len=4096)
    assert p.num_gpu_blocks == 1000 and p.num_gpu_blocks_overridden
    with pytest.raises(ConfigError, match=r"max_model_len=8192 needs 512 KV blocks.*499 usable"):
        plan_memory(LLAMA8, H100, num_gpu_blocks=500)


def test_weights_that_do_not_fit_fail_with_the_numbers():
    with pytest.raises(ConfigError) as e:
        plan_memory(load_model("llama-3-70b"), H100)
    msg = str(e.value)
    assert "does not fit on 1x h100" in msg
    assert "131.42 GiB of weights" in msg and "allows 71.68 GiB" in msg
    plan_memory(load_model("llama-3-70b"), H100, tensor_parallel_size=4)  # fits
    with pytest.raises(ConfigError, match="does not fit on 8x h100"):
        plan_memory(load_model("deepseek-v3"), H100, tensor_parallel_size=8)
    plan_memory(load_model("deepseek-v3"), load_hardware("h200"), tensor_parallel_size=8)


def test_max_model_len_beyond_the_kv_cache_fails_with_the_numbers():
    # Qwen3-32B on one A100: ~8.6 GiB of KV left, 256 KiB per token, 40960 tokens asked.
    with pytest.raises(ConfigError) as e:
        plan_memory(load_model("qwen3-32b"), load_hardware("a100"), max_num_batched_tokens=2048)
    msg = str(e.value)
    assert "max_model_len=40960 needs 10.00 GiB of KV cache" in msg
    assert "256.0 KiB per token" in msg and "at most" in msg
    fit = int(msg.split("at most ")[1].split(")")[0])
    p = plan_memory(
        load_model("qwen3-32b"), load_hardware("a100"), max_num_batched_tokens=2048, max_model_len=fit
    )
    assert p.kv_cache_tokens >= fit


def test_max_model_len_beyond_the_model_fails():
    with pytest.raises(ConfigError, match="greater than the model's maximum context length"):
        plan_memory(LLAMA8, H100, max_model_len=100_000)


def test_bad_utilization():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        plan_memory(LLAMA8, H100, gpu_memory_utilization=1.5)
    assert plan_memory(LLAMA8, H100).to_dict()["kv_cache_gib"] > 50 * GiB / GiB
