"""The float32 SwiGLU kernel (swiglu.c): PyTorch's silu-then-multiply bits in one pass, checked at load."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from llmsched.executor.torch.kernels.library import ARGS_I as _I
from llmsched.executor.torch.kernels.library import ARGS_L as _L
from llmsched.executor.torch.kernels.library import ARGS_P as _P
from llmsched.executor.torch.kernels.library import library

logger = logging.getLogger(__name__)


class SwiGLUKernel:
    """silu(gate) * up over float32 [tokens, 2 * intermediate] rows, with the PyTorch path's bits."""

    __slots__ = ("_swiglu",)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._swiglu = lib.llmsched_swiglu_f32
        self._swiglu.argtypes = [_P, _L, _I, _I, _P, _L, _I]
        self._swiglu.restype = None

    @staticmethod
    def takes(gate_up: torch.Tensor) -> bool:
        """Whether gate_up (2-D float32 CPU rows, contiguous within, halves in 16s) suits the kernel."""
        return (
            gate_up.dtype == torch.float32
            and gate_up.device.type == "cpu"
            and gate_up.dim() == 2
            and gate_up.stride(-1) == 1
            and gate_up.shape[-1] % 32 == 0
        )

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up as a new contiguous [tokens, intermediate] tensor."""
        rows, half = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, half), dtype=gate_up.dtype)
        self._swiglu(
            gate_up.data_ptr(), gate_up.stride(0), rows, half, out.data_ptr(), out.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip
        return out


def same_bits_as_torch(kern: SwiGLUKernel) -> bool:
    """Whether the kernel gives this PyTorch's silu-then-multiply bits, over the whole float range."""
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(-30, 2, 64)[:, None]
    gate = torch.randn(64, 512, generator=g) * scales
    gate[0, :8] = torch.tensor([0.0, -0.0, 88.5, -88.5, 104.5, -104.5, float("inf"), -float("inf")])
    gate[1, :8] = torch.tensor([1e-38, -1e-38, 15.9, -15.9, 100.5, -103.9, 0.5, -0.5])
    gate_up = torch.cat((gate, torch.randn(64, 512, generator=g) * 3), 1)
    want = F.silu(gate_up[:, :512]).mul_(gate_up[:, 512:])
    got = kern.swiglu(gate_up)
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@functools.cache
def swiglu_kernel() -> SwiGLUKernel | None:
    """The SwiGLU kernel; None when the library is off or unbuilt, the CPU lacks AVX2, or the bits differ."""
    lib = library()
    if lib is None or not lib.llmsched_swiglu_f32_supported():
        return None
    kern = SwiGLUKernel(lib)
    if not same_bits_as_torch(kern):
        logger.warning("CPU SwiGLU kernel off: its float32 bits do not match this PyTorch's silu")
        return None
    return kern
