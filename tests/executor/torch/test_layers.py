"""RMSNorm and SwiGLU against transformers' definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmsched.executor.torch.layers import rms_norm, swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 48, generator=g) * 3).to(dtype)
    ref = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(48, generator=g))
    ref = ref.to(dtype)
    before = x.clone()
    out = rms_norm(x, ref.weight.detach(), 1e-5)
    assert out.dtype is dtype
    assert torch.equal(out, ref(x).detach())
    assert torch.equal(x, before)  # the input is left alone


def test_rms_norm_per_head_weights_broadcast():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 8, generator=g)
    w = torch.randn(3, 8, generator=g)
    out = rms_norm(x, w, 1e-6)
    for h in range(3):
        assert torch.equal(out[:, h], rms_norm(x[:, h], w[h], 1e-6))


def test_swiglu():
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(4, 10, generator=g)
    assert torch.allclose(swiglu(gate_up), F.silu(gate_up[:, :5]) * gate_up[:, 5:])
