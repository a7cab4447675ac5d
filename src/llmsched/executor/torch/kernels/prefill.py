"""The causal prefill attention kernels: bfloat16 chunks (prefill_attention.c) and float32 chunks
(prefill_attention_f32.c), each with bits of its own."""

from __future__ import annotations

import ctypes
import functools

import torch

from llmsched.executor.torch.kernels.library import ARGS_I as _I
from llmsched.executor.torch.kernels.library import ARGS_L as _L
from llmsched.executor.torch.kernels.library import ARGS_P as _P
from llmsched.executor.torch.kernels.library import library


class PrefillAttentionKernel:
    """Causal attention of a prefill chunk's queries over its context's keys and values, in one dtype."""

    __slots__ = ("_attend", "dtype", "head_dim_step", "max_head_dim")

    def __init__(
        self,
        attend: ctypes._CFuncPtr,
        dtype: torch.dtype,
        max_head_dim: int,
        head_dim_step: int,
    ) -> None:
        self._attend = attend
        # q, k, v and out (each a pointer and two strides), sizes, scale, threads.
        self._attend.argtypes = [*[_P, _L, _L] * 4, _I, _I, _I, _I, _I, ctypes.c_float, _I]
        self._attend.restype = _I
        self.dtype = dtype
        self.max_head_dim = max_head_dim
        # Head sizes run in multiples of this (the kernel's vector blocking).
        self.head_dim_step = head_dim_step

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this kernel runs a layer of this dtype and head size."""
        return dtype == self.dtype and head_dim % self.head_dim_step == 0 and head_dim <= self.max_head_dim

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
    ) -> None:
        """out [lq, heads, d] = attention of q [lq, heads, d] over k, v [lk, kv_heads, d].

        Query i sees keys 0..lk-lq+i. Any strides, with each row's head_dim
        values contiguous.
        """
        lq, nh, d = q.shape
        lk, kvh, _ = k.shape
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t.stride(-1) != 1 or t.dtype != self.dtype:
                raise ValueError(
                    f"prefill attention: {name} must be {self.dtype} with each row's head_dim values "
                    f"contiguous, got {t.dtype} with strides {tuple(t.stride())}"
                )
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
    """The bfloat16 prefill kernel; None when the library is off or unbuilt or the CPU lacks AVX-512 BF16."""
    lib = library()
    if lib is None:
        return None
    max_head_dim = lib.llmsched_prefill_supported()
    if max_head_dim <= 0:
        return None
    return PrefillAttentionKernel(lib.llmsched_prefill_attention, torch.bfloat16, max_head_dim, 64)


@functools.cache
def prefill_attention_f32() -> PrefillAttentionKernel | None:
    """The float32 prefill kernel; None when the library is off or unbuilt or the CPU lacks AVX2 and FMA."""
    lib = library()
    if lib is None:
        return None
    max_head_dim = lib.llmsched_prefill_f32_supported()
    if max_head_dim <= 0:
        return None
    return PrefillAttentionKernel(lib.llmsched_prefill_attention_f32, torch.float32, max_head_dim, 16)


def prefill_attention_for(dtype: torch.dtype) -> PrefillAttentionKernel | None:
    """The prefill kernel for a model in ``dtype`` (bfloat16 or float32); None for any other or none built."""
    if dtype == torch.bfloat16:
        return prefill_attention()
    return prefill_attention_f32() if dtype == torch.float32 else None
