"""The bfloat16 RMSNorm kernels (rms_norm.c): the PyTorch chain's bits, checked when loaded."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from llmsched.executor.torch.kernels.library import ARGS_I as _I
from llmsched.executor.torch.kernels.library import ARGS_L as _L
from llmsched.executor.torch.kernels.library import ARGS_P as _P
from llmsched.executor.torch.kernels.library import library

logger = logging.getLogger(__name__)

# PyTorch splits one long row's sum over threads past its grain size (32768).
MAX_NORM_WIDTH = 32768


class RMSNormKernels:
    """RMSNorm over bfloat16 rows, alone or after the residual add, with the PyTorch path's bits."""

    __slots__ = ("_add_norm", "_norm", "lanes")

    def __init__(self, lib: ctypes.CDLL, lanes: int) -> None:
        self._norm = lib.llmsched_rms_norm
        self._norm.argtypes = [_P, _L, _L, _I, _I, _I, _P, ctypes.c_float, _I, _P, _L, _L, _I]
        self._norm.restype = None
        self._add_norm = lib.llmsched_add_rms_norm
        self._add_norm.argtypes = [_P, _L, _P, _L, _I, _I, _P, ctypes.c_float, _I, _P, _L, _I]
        self._add_norm.restype = None
        # PyTorch's float vector width, which sets the order of its sums.
        self.lanes = lanes

    @staticmethod
    def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether x ([tokens, h] or [tokens, heads, h], rows contiguous) and weight [h] suit the kernels."""
        return (
            x.dtype == weight.dtype == torch.bfloat16
            and x.dim() in (2, 3)
            and x.stride(-1) == 1
            and weight.dim() == 1
            and weight.shape[0] == x.shape[-1]
            and weight.is_contiguous()
            and x.shape[-1] <= MAX_NORM_WIDTH
            and x.device.type == "cpu"
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x's last dim, scaled by weight, as a new contiguous tensor."""
        out = torch.empty(x.shape, dtype=x.dtype)
        x3, o3 = (x, out) if x.dim() == 3 else (x[:, None], out[:, None])
        self._norm(
            x3.data_ptr(), x3.stride(0), x3.stride(1), *x3.shape, weight.data_ptr(),
            eps, self.lanes, o3.data_ptr(), o3.stride(0), o3.stride(1), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (both [tokens, h]), then the RMSNorm of x."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self._add_norm(
            x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0), x.shape[0], x.shape[1],
            weight.data_ptr(), eps, self.lanes, out.data_ptr(), out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return out


def sum_order_lanes(lib: ctypes.CDLL) -> int | None:
    """The vector width (8 or 16 lanes) with which the kernel's sums of squares have this PyTorch's bits.

    PyTorch's sum adds a row as float vectors of a width its build picks
    (8 lanes in 2.13's AVX2 and AVX-512 kernels alike); the kernel follows
    either, so it is checked here against rows whose sums show their order.
    """
    fn = lib.llmsched_sum_squares
    fn.argtypes = [_P, _L, _I, _I, _I, _P]
    fn.restype = None
    g = torch.Generator().manual_seed(0)
    rows = [
        (torch.randn(64, h, generator=g) * torch.logspace(-3, 3, 64)[:, None]).bfloat16()
        for h in PROBE_WIDTHS
    ]
    for lanes in (8, 16):
        ok = True
        for x in rows:
            sums = torch.empty(x.shape[0])
            fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], lanes, sums.data_ptr())
            ok = ok and torch.equal(sums / x.shape[1], x.float().square().mean(-1))
        if ok:
            return lanes
    return None


# Row widths whose sums exercise every part of the order: under one vector,
# leftover scalars, leftover vectors, whole groups of 4, and the cascade
# over 16 groups.
PROBE_WIDTHS = (7, 13, 24, 100, 576, 4096 + 40)


@functools.cache
def rms_norm_kernels() -> RMSNormKernels | None:
    """The RMSNorm kernels; None when the library is off or unbuilt, or cannot give this PyTorch's bits."""
    lib = library()
    if lib is None:
        return None
    lanes = sum_order_lanes(lib)
    if lanes is None:
        logger.warning("CPU RMSNorm kernel off: its sums do not match this PyTorch's order")
        return None
    return RMSNormKernels(lib, lanes)
