"""Device, dtype and thread choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmsched.core.errors import ConfigError
from llmsched.executor.platform import usable_cores
from llmsched.executor.torch import device as device_module
from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.device import (
    auto_dtype,
    available_host_memory,
    choose_dtype,
    configure_threads,
    cpu_dtypes,
    cuda_dtypes,
    resolve_device,
    resolve_dtype,
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


# vLLM 0.33 on an x86 CPU (platforms/cpu.py supported_dtypes: bfloat16, float16,
# float32; config/model.py _resolve_auto_dtype): float32 -> bfloat16, the
# others kept. float16 is refused on CPU here, so it takes the preferred dtype.
@pytest.mark.parametrize(
    ("declared", "bf16_cpu", "expected", "note"),
    [
        ("float32", True, torch.bfloat16, "checkpoint float32 -> bfloat16 (as vLLM does on CPU)"),
        (None, True, torch.bfloat16, "checkpoint float32 (none declared) -> bfloat16 (as vLLM does on CPU)"),
        ("bfloat16", True, torch.bfloat16, "checkpoint bfloat16 kept (as vLLM does on CPU)"),
        (
            "float16",
            True,
            torch.bfloat16,
            "checkpoint float16 -> bfloat16 (vLLM keeps float16;",
        ),
        # Without bf16 matmuls everything runs float32 (vLLM would pick bfloat16, emulated).
        ("float32", False, torch.float32, "checkpoint float32 kept (this CPU has no bfloat16 matmuls"),
        (None, False, torch.float32, "checkpoint float32 (none declared) kept (this CPU has no bfloat16"),
        ("bfloat16", False, torch.float32, "checkpoint bfloat16 -> float32 (this CPU has no bfloat16"),
        ("float16", False, torch.float32, "checkpoint float16 -> float32 (vLLM keeps float16"),
    ],
)
def test_auto_dtype_on_cpu(monkeypatch, declared, bf16_cpu, expected, note):
    monkeypatch.setattr(device_module, "cpu_bf16_matmuls", lambda: bf16_cpu)
    dt, line = choose_dtype("auto", config(declared), torch.device("cpu"))
    assert dt is expected
    assert line.startswith(f"dtype auto: {note}")
    assert resolve_dtype("auto", config(declared), torch.device("cpu")) is expected


@pytest.mark.parametrize(
    ("capability", "declared", "expected"),
    [
        # Ampere and later: bfloat16 preferred.
        ((8, 0), "float32", torch.bfloat16),
        ((9, 0), None, torch.bfloat16),
        ((8, 6), "float16", torch.float16),
        ((8, 0), "bfloat16", torch.bfloat16),
        # Pascal to Turing: no bfloat16, float16 preferred (a bf16 checkpoint falls back to it).
        ((7, 5), "float32", torch.float16),
        ((7, 0), "bfloat16", torch.float16),
        ((6, 0), "float16", torch.float16),
        # Older: float32 only.
        ((5, 2), "float16", torch.float32),
        ((5, 2), "float32", torch.float32),
    ],
)
def test_auto_dtype_cuda_rule(capability, declared, expected):
    ckpt = torch.float32 if declared is None else getattr(torch, declared)
    assert auto_dtype(ckpt, cuda_dtypes(capability)) is expected


def test_cpu_dtype_preference():
    assert cpu_dtypes(True)[0] is torch.bfloat16
    assert cpu_dtypes(False)[0] is torch.float32
    assert torch.float16 not in cpu_dtypes(True) + cpu_dtypes(False)


def test_explicit_dtypes():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", config(None), cpu) is torch.float32
    assert resolve_dtype("bf16", config(None), cpu) is torch.bfloat16
    assert resolve_dtype(torch.float32, config(None), cpu) is torch.float32
    assert choose_dtype("bfloat16", config("float32"), cpu) == (torch.bfloat16, "dtype bfloat16 (as asked)")
    with pytest.raises(ConfigError, match="float16 is not supported on CPU"):
        resolve_dtype("float16", config(None), cpu)
    with pytest.raises(ConfigError, match="dtype='int8'"):
        resolve_dtype("int8", config(None), cpu)


def test_threads():
    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1
        assert torch.get_num_threads() == 1
        assert configure_threads(None) == usable_cores()
        with pytest.raises(ConfigError, match="num_threads"):
            configure_threads(0)
    finally:
        torch.set_num_threads(before)


def test_available_memory_is_plausible():
    assert 64 << 20 < available_host_memory() < 1 << 50
