"""RMSNorm and SwiGLU against transformers' definitions; the prepacked linear against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmsched.executor.torch.layers import (
    can_prepack_linears,
    packed_linear,
    prepack_linear,
    rms_norm,
    swiglu,
)


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


@pytest.mark.skipif(
    not can_prepack_linears(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 on this CPU"
)
@pytest.mark.parametrize("rows", [1, 5, 64, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_bit_for_bit(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    # A strided input too, as the attention output and activations can be.
    x = torch.randn(rows, 160, generator=g).bfloat16()[:, ::2]
    assert torch.equal(packed_linear(x, prepack_linear(w), b), F.linear(x, w, b))


def test_prepacking_is_for_cpu_bf16_only():
    assert not can_prepack_linears(torch.device("cpu"), torch.float32)
    assert not can_prepack_linears(torch.device("cuda"), torch.bfloat16)
