"""The causal prefill attention kernel (prefill_attention.c): bfloat16 chunks, bits of its own."""

from __future__ import annotations

import ctypes
import functools

import torch

from llmsched.executor.torch.kernels.library import ARGS_I as _I
from llmsched.executor.torch.kernels.library import ARGS_L as _L
from llmsched.executor.torch.kernels.library import ARGS_P as _P
from llmsched.executor.torch.kernels.library import library


class PrefillAttentionKernel:
    """Causal attention of a prefill chunk's bfloat16 queries over its context's keys and values."""

    __slots__ = ("_attend", "max_head_dim")

    def __init__(self, lib: ctypes.CDLL, max_head_dim: int) -> None:
        self._attend = lib.llmsched_prefill_attention
        # q, k, v and out (each a pointer and two strides), sizes, scale, threads.
        self._attend.argtypes = [*[_P, _L, _L] * 4, _I, _I, _I, _I, _I, ctypes.c_float, _I]
        self._attend.restype = _I
        self.max_head_dim = max_head_dim

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this kernel runs a layer of this dtype and head size."""
        return dtype == torch.bfloat16 and head_dim % 64 == 0 and head_dim <= self.max_head_dim

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
    ) -> None:
        """out [lq, heads, d] = attention of q [lq, heads, d] over k, v [lk, kv_heads, d].

        Query i sees keys 0..lk-lq+i. Any strides, with each row's head_dim
        values contiguous.
        """
        lq, nh, d = q.shape
        lk, kvh, _ = k.shape
        failed = self._attend(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            lq, lk, nh, kvh, d, scale, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(
                f"prefill attention: no memory to repack {lk} keys and values of {kvh} KV heads"
            )


@functools.cache
def prefill_attention() -> PrefillAttentionKernel | None:
    """The prefill attention kernel; None when the library is off or unbuilt or the CPU lacks AVX-512 BF16."""
    lib = library()
    if lib is None:
        return None
    max_head_dim = lib.llmsched_prefill_supported()
    return PrefillAttentionKernel(lib, max_head_dim) if max_head_dim > 0 else None
