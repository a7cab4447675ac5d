"""The C RMSNorm against the chain of PyTorch ops it replaces: the same bits, whatever the shape."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys

import pytest
import torch

from llmsched.executor.torch import kernels, layers
from llmsched.executor.torch.kernels import rms_norm

from ..conftest import bfloat16_outputs, prompts_of

KERNELS = kernels.rms_norm_kernels()
# Skipped only without a C compiler; a kernel that fails to compile fails these.
pytestmark = pytest.mark.usefixtures("kernels_built")


def test_the_kernel_passes_its_load_time_check_here():
    # Not skipped when it fails: a kernel whose sums lost PyTorch's order is a regression.
    assert KERNELS is not None


# Row widths across the sum's structure: under one vector, leftover vectors
# and scalars, whole groups, and over 16 groups (the cascade folds).
WIDTHS = [1, 7, 24, 64, 100, 128, 576, 1000, 1536, 2048, 4096, 5120, 16384, 65584]


def torch_chain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.rms_norm's PyTorch ops, with the kernel out of the way."""
    saved = layers.rms_norm_kernels
    layers.rms_norm_kernels = lambda: None
    try:
        return layers.rms_norm(x, weight, eps)
    finally:
        layers.rms_norm_kernels = saved


def sum_squares(x: torch.Tensor, lanes: int) -> torch.Tensor:
    """The kernel's float32 sum of each row's squares."""
    fn = kernels.library().llmsched_sum_squares
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    out = torch.empty(x.shape[0])
    fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], lanes, out.data_ptr())
    return out


@pytest.mark.parametrize("width", WIDTHS)
def test_the_sum_of_squares_adds_in_pytorchs_order(width):
    """Float32 sums whose order shows: a sum in another order differs in its last bits."""
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(256, width, generator=g) * torch.logspace(-3, 3, 256)[:, None]).bfloat16()
    assert torch.equal(sum_squares(x, KERNELS.lanes), x.float().square().sum(-1))


@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_has_the_pytorch_chains_bits(width):
    g = torch.Generator().manual_seed(width)
    for rows in (1, 5, 64):
        x = (torch.randn(rows, width, generator=g) * 3).bfloat16()
        w = torch.randn(width, generator=g).bfloat16()
        assert torch.equal(KERNELS.rms_norm(x, w, 1e-6), torch_chain(x, w, 1e-6))


def test_per_head_norm_over_a_strided_view_and_the_layer_routes_to_it():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 12, 128, generator=g).bfloat16()
    qk, w = qkv[:, :10], torch.randn(128, generator=g).bfloat16()
    assert KERNELS.takes(qk, w)
    assert torch.equal(layers.rms_norm(qk, w, 1e-5), torch_chain(qk, w, 1e-5))
    assert torch.equal(layers.rms_norm(qk, w, 1e-5), KERNELS.rms_norm(qk, w, 1e-5))
    assert not KERNELS.takes(qk.float(), w.float()) and not KERNELS.takes(qk, w[:64])


def test_add_rms_norm_adds_in_place_then_normalises_with_the_chains_bits():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(33, 576, generator=g).bfloat16()
    delta = torch.randn(33, 600, generator=g).bfloat16()[:, :576]  # strided rows
    w = torch.randn(576, generator=g).bfloat16()
    want_x = x + delta
    want = torch_chain(want_x, w, 1e-6)
    out = layers.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(x, want_x) and torch.equal(out, want)


def test_add_rms_norm_with_a_broadcast_delta_adds_it_to_every_row():
    """The kernel reads delta row by row, so a [1, h] delta takes the PyTorch path, which broadcasts it."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 64, generator=g).bfloat16()
    delta, w = torch.randn(1, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    want_x = x + delta
    out = layers.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(x, want_x) and torch.equal(out, torch_chain(want_x, w, 1e-6))


def test_a_pytorch_that_sums_in_another_order_gets_no_kernel(caplog):
    """The load-time check: sums one ulp off in any row switch the kernel off, with a warning."""
    lib = kernels.library()

    @ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p
    )
    def nudged(x, stride, n, h, lanes, out):
        lib.llmsched_sum_squares(x, stride, n, h, lanes, out)
        sums = (ctypes.c_float * n).from_address(out)
        sums[n - 1] = float(torch.tensor(sums[n - 1]).nextafter(torch.tensor(float("inf"))))

    class Lib:
        llmsched_sum_squares = nudged

    assert rms_norm.sum_order_lanes(lib) == KERNELS.lanes
    assert rms_norm.sum_order_lanes(Lib()) is None
    kernels.rms_norm_kernels.cache_clear()
    try:
        kernels.library.cache_clear()
        import unittest.mock

        with unittest.mock.patch.object(rms_norm, "library", lambda: Lib()), caplog.at_level(logging.WARNING):
            assert kernels.rms_norm_kernels() is None
        assert "RMSNorm kernel off" in caplog.text
    finally:
        kernels.clear_caches()


def test_wider_rows_than_pytorch_sums_on_one_thread_are_left_to_it():
    w = torch.ones(kernels.MAX_NORM_WIDTH + 1, dtype=torch.bfloat16)
    assert not KERNELS.takes(torch.ones(1, w.shape[0], dtype=torch.bfloat16), w)


def test_two_threads_give_one_threads_bits():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(512, 2048, generator=g).bfloat16(), torch.randn(2048, generator=g).bfloat16()
    two = KERNELS.rms_norm(x, w, 1e-6)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(KERNELS.rms_norm(x, w, 1e-6), two)
    finally:
        torch.set_num_threads(threads)


def test_an_avx2_pytorchs_sums_are_followed_too():
    """With ATEN_CPU_CAPABILITY=avx2 PyTorch runs its AVX2 kernels; the kernel still has their bits."""
    code = (
        "import torch\n"
        "from llmsched.executor.torch import kernels, layers\n"
        "assert torch.backends.cpu.get_cpu_capability() == 'AVX2'\n"
        "k = kernels.rms_norm_kernels()\n"
        "layers.rms_norm_kernels = lambda: None\n"
        "g = torch.Generator().manual_seed(0)\n"
        f"for width in {WIDTHS}:\n"
        "    x = torch.randn(7, width, generator=g).bfloat16()\n"
        "    w = torch.randn(width, generator=g).bfloat16()\n"
        "    assert torch.equal(k.rms_norm(x, w, 1e-6), layers.rms_norm(x, w, 1e-6)), width\n"
        "    y = (torch.randn(256, width, generator=g) * torch.logspace(-3, 3, 256)[:, None]).bfloat16()\n"
        "    sums = torch.empty(256)\n"
        "    fn = kernels.library().llmsched_sum_squares\n"
        "    fn(y.data_ptr(), width, 256, width, k.lanes, sums.data_ptr())\n"
        "    assert torch.equal(sums, y.float().square().sum(-1)), width\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_bfloat16_engine_gives_the_same_tokens_with_and_without_it(tiny_models, monkeypatch):
    model = tiny_models["qwen3"]  # per-head q/k norms too
    prompts = prompts_of([5, 19, 33, 12, 40, 7])

    calls = []
    norm = kernels.RMSNormKernels.rms_norm
    monkeypatch.setattr(kernels.RMSNormKernels, "rms_norm", lambda *a: calls.append(1) or norm(*a))
    with_kernel = bfloat16_outputs(model.path, prompts, 24)
    assert calls
    monkeypatch.setattr(layers, "rms_norm_kernels", lambda: None)
    assert bfloat16_outputs(model.path, prompts, 24) == with_kernel
