"""Device, dtype and thread choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmsched.core.errors import ConfigError
from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.device import (
    available_host_memory,
    configure_threads,
    resolve_device,
    resolve_dtype,
    usable_cpus,
)


def config(torch_dtype: str | None) -> ModelConfig:
    return ModelConfig(
        path=Path("m"),
        architecture="LlamaForCausalLM",
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=16,
        rope_theta=10000.0,
        torch_dtype=torch_dtype,
    )


def test_auto_device_is_cpu_without_cuda():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_is_refused_only_without_cuda():
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
    else:
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")


def test_unknown_device():
    with pytest.raises(ConfigError, match="device="):
        resolve_device("tpu0")


@pytest.mark.parametrize(
    ("declared", "expected"),
    [
        ("bfloat16", torch.bfloat16),
        ("float16", torch.bfloat16),
        (None, torch.bfloat16),
        ("float32", torch.float32),
    ],
)
def test_auto_dtype_on_cpu(declared, expected):
    assert resolve_dtype("auto", config(declared), torch.device("cpu")) is expected


def test_explicit_dtypes():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", config(None), cpu) is torch.float32
    assert resolve_dtype("bf16", config(None), cpu) is torch.bfloat16
    assert resolve_dtype(torch.float32, config(None), cpu) is torch.float32
    with pytest.raises(ConfigError, match="float16 is not supported on CPU"):
        resolve_dtype("float16", config(None), cpu)
    with pytest.raises(ConfigError, match="dtype='int8'"):
        resolve_dtype("int8", config(None), cpu)


def test_threads():
    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1
        assert torch.get_num_threads() == 1
        assert configure_threads(None) == usable_cpus()
        with pytest.raises(ConfigError, match="num_threads"):
            configure_threads(0)
    finally:
        torch.set_num_threads(before)


def test_available_memory_is_plausible():
    assert 64 << 20 < available_host_memory() < 1 << 50
