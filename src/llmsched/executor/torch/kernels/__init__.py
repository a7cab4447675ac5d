"""C kernels for the CPU path, loaded with ctypes, each with a PyTorch path to fall back on.

- ``decode_attention()``: the paged decode attention kernels
  (decode_attention.c), with the embedding_bag path's bits;
- ``prefill_attention()``: the causal prefill attention kernel
  (prefill_attention.c), 3-4x faster than PyTorch's SDPA on bfloat16
  chunks, with bits of its own; it needs a CPU with AVX-512 BF16;
- ``prefill_attention_f32()``: its float32 twin (prefill_attention_f32.c),
  for CPUs with AVX2 and FMA, faster than PyTorch's SDPA on float32 chunks;
- ``rms_norm_kernels()``: bfloat16 RMSNorm, alone or after the residual
  add, in one pass with the PyTorch chain's bits (rms_norm.c), checked
  against this PyTorch's sums when loaded;
- ``swiglu_kernel()``: float32 SwiGLU (silu(gate) * up) in one pass with
  PyTorch's bits (swiglu.c), checked against this PyTorch's silu when loaded.

All are None when the kernels are switched off (``LLMSCHED_CPU_KERNELS=0``)
or cannot be built here, in which case the reason is logged once and the
PyTorch paths run.
"""

from __future__ import annotations

from llmsched.executor.torch.kernels.decode import DecodeAttentionKernels, decode_attention
from llmsched.executor.torch.kernels.library import enabled, library
from llmsched.executor.torch.kernels.prefill import (
    PrefillAttentionKernel,
    prefill_attention,
    prefill_attention_f32,
    prefill_attention_for,
)
from llmsched.executor.torch.kernels.rms_norm import MAX_NORM_WIDTH, RMSNormKernels, rms_norm_kernels
from llmsched.executor.torch.kernels.swiglu import SwiGLUKernel, swiglu_kernel

__all__ = [
    "MAX_NORM_WIDTH",
    "DecodeAttentionKernels",
    "PrefillAttentionKernel",
    "RMSNormKernels",
    "SwiGLUKernel",
    "clear_caches",
    "decode_attention",
    "enabled",
    "library",
    "prefill_attention",
    "prefill_attention_f32",
    "prefill_attention_for",
    "rms_norm_kernels",
    "swiglu_kernel",
]


def clear_caches() -> None:
    """Forget the loaded library and kernels, so the next call looks again (the environment, the compiler)."""
    for cached in (
        library,
        decode_attention,
        prefill_attention,
        prefill_attention_f32,
        rms_norm_kernels,
        swiglu_kernel,
    ):
        cached.cache_clear()
