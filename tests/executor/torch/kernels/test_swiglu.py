"""The float32 SwiGLU kernel: PyTorch's silu-then-multiply bits in one pass, and the load-time check that
turns it off where they differ."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmsched.executor.torch import kernels, layers
from llmsched.executor.torch.kernels.swiglu import SwiGLUKernel, same_bits_as_torch


@pytest.fixture
def kern(kernels_built: None) -> SwiGLUKernel:
    """The kernel; skipped only on a CPU without AVX2 and FMA (a failed bit check fails the tests)."""
    lib = kernels.library()
    if lib is None or not lib.llmsched_swiglu_f32_supported():
        pytest.skip("this CPU lacks AVX2 and FMA, which the SwiGLU kernel needs")
    k = kernels.swiglu_kernel()
    assert k is not None, "the kernel's bits differ from this PyTorch's silu (see the log)"
    return k


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :half]).mul_(gate_up[:, half:])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs where NaNs are."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("rows,half", [(1, 16), (7, 48), (300, 96), (2048, 1536)])
@pytest.mark.parametrize("scale", [1e-20, 1.0, 8.0, 60.0])
def test_gives_pytorchs_bits(kern, rows, half, scale):
    g = torch.Generator().manual_seed(rows + half)
    gate_up = torch.randn(rows, 2 * half, generator=g) * scale
    assert same(kern.swiglu(gate_up), reference(gate_up))


def test_edges_of_the_range_and_strided_rows(kern):
    """Zeros, infinities, exp's overflow and underflow cut-offs; rows of a wider tensor (a column slice)."""
    edges = torch.tensor([0.0, -0.0, 88.7, -88.7, 100.5, -103.9, 104.5, -104.5, float("inf"), -float("inf")])
    wide = torch.randn(40, 200)
    wide[:, :10] = edges
    wide[:, 100:110] = edges.flip(0)
    gate_up = wide[:, 4:196]  # halves of 96, row stride 200
    assert same(kern.swiglu(gate_up), reference(gate_up))


def test_the_thread_count_does_not_change_the_bits(kern):
    gate_up = torch.randn(512, 512) * 5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kern.swiglu(gate_up)
        torch.set_num_threads(2)
        assert torch.equal(kern.swiglu(gate_up), one)
    finally:
        torch.set_num_threads(threads)


def test_takes_float32_rows_with_halves_in_16s_only():
    assert SwiGLUKernel.takes(torch.zeros(3, 64))
    assert not SwiGLUKernel.takes(torch.zeros(3, 48))  # halves of 24
    assert not SwiGLUKernel.takes(torch.zeros(3, 64, dtype=torch.bfloat16))
    assert not SwiGLUKernel.takes(torch.zeros(2, 3, 64))
    assert not SwiGLUKernel.takes(torch.zeros(64, 3).t())


def test_layers_swiglu_runs_the_kernel_for_float32(kern, monkeypatch):
    calls = []
    run = SwiGLUKernel.swiglu
    monkeypatch.setattr(SwiGLUKernel, "swiglu", lambda *a: calls.append(1) or run(*a))
    gate_up = torch.randn(5, 64)
    assert torch.equal(layers.swiglu(gate_up), reference(gate_up)) and calls
    layers.swiglu(gate_up.bfloat16())
    layers.swiglu(torch.randn(5, 48))
    assert len(calls) == 1


def test_the_load_check_refuses_a_kernel_one_ulp_off(kern):
    class OneUlpOff:
        def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
            out = kern.swiglu(gate_up)
            out[3, 5] = torch.nextafter(out[3, 5], torch.tensor(float("inf")))
            return out

    assert same_bits_as_torch(kern)
    assert not same_bits_as_torch(OneUlpOff())  # type: ignore[arg-type]
