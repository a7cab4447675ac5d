"""KV cache sizing and allocation."""

from __future__ import annotations

import pytest
import torch

from llmsched.core.errors import ConfigError
from llmsched.executor.torch import KVCacheTooSmall, ModelConfig
from llmsched.executor.torch.kv_cache import (
    DEFAULT_CPU_KV_BYTES,
    KVCache,
    bytes_per_block,
    plan_kv_cache,
)

CPU = torch.device("cpu")


@pytest.fixture
def cfg(tiny_models) -> ModelConfig:
    return ModelConfig.from_folder(tiny_models["llama"].path)


def plan(cfg: ModelConfig, **kw):
    args = {
        "device": CPU,
        "dtype": torch.float32,
        "block_size": 4,
        "max_model_len": 64,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "num_gpu_blocks": None,
        "kv_cache_memory": None,
        "gpu_memory_utilization": 0.9,
    } | kw
    return plan_kv_cache(cfg, **args)


def test_bytes_per_block(cfg):
    # K and V, 2 layers, 4 tokens, 2 KV heads of 16 dims, 4 bytes.
    assert bytes_per_block(cfg, 4, torch.float32) == 2 * 2 * 4 * 2 * 16 * 4
    assert bytes_per_block(cfg, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2


def test_explicit_block_count(cfg):
    p = plan(cfg, num_gpu_blocks=40)
    assert p.num_blocks == 40
    assert "num_gpu_blocks=40" in p.source


def test_memory_budget(cfg):
    per = bytes_per_block(cfg, 4, torch.float32)
    p = plan(cfg, kv_cache_memory=100 * per + per // 2)
    assert p.num_blocks == 100
    assert p.num_bytes == 100 * per


def test_cpu_default_is_capped_by_what_can_be_used(cfg):
    p = plan(cfg)
    # 8 sequences of 64 tokens in 4-token blocks, plus the null block.
    assert p.num_blocks == 8 * 16 + 1
    assert "CPU default" in p.source
    big = plan(cfg, max_num_seqs=10**6, max_model_len=256)
    assert big.num_bytes <= DEFAULT_CPU_KV_BYTES


def test_too_small_says_what_is_needed_and_available(cfg):
    with pytest.raises(KVCacheTooSmall) as e:
        plan(cfg, num_gpu_blocks=10, max_model_len=64)
    msg = str(e.value)
    assert "max_model_len=64" in msg
    assert "needs 16 blocks of 4 tokens" in msg
    assert "gives 9 usable blocks" in msg
    assert "at most 36" in msg
    with pytest.raises(KVCacheTooSmall, match="kv_cache_memory"):
        plan(cfg, kv_cache_memory=1000)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_gpu_blocks": 1}, "num_gpu_blocks"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"kv_cache_memory": 1 << 60}, "exceeds 90%"),
    ],
)
def test_invalid_sizes(cfg, kw, match):
    with pytest.raises(ConfigError, match=match):
        plan(cfg, **kw)


def test_cache_tensors(cfg):
    p = plan(cfg, num_gpu_blocks=12, max_model_len=32)
    kv = KVCache(cfg, p, torch.bfloat16, CPU)
    assert len(kv.key) == len(kv.value) == cfg.num_layers
    assert kv.key[0].shape == (12, 4, cfg.num_kv_heads, cfg.head_dim)
    assert kv.value[1].dtype is torch.bfloat16
    assert kv.key[0].data_ptr() != kv.value[0].data_ptr()
    # One head-major allocation per layer: K then V, each KV head contiguous.
    assert kv.blocks[0].shape == (2, cfg.num_kv_heads, 12, 4, cfg.head_dim)
    assert kv.value[0].data_ptr() == kv.key[0].data_ptr() + kv.blocks[0][0].numel() * 2
    kv.blocks[0][0, 1, 5, 3] = 1.0
    assert kv.key[0][5, 3, 1].eq(1.0).all() and kv.key[0].sum() == cfg.head_dim
    assert not kv.blocks[1].any()
