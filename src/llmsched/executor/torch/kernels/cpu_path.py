"""Which CPU path a model runs on this processor, in one start-up line.

The kernels are chosen once, by what the CPU offers: the bfloat16 C kernels
(prefill attention, RMSNorm) need AVX-512 BF16, the float32 ones (prefill
attention, SwiGLU) AVX2 and FMA, and oneDNN runs the matmuls (natively in
bfloat16 only with AVX-512 BF16 or AMX). The line names the processor's
relevant features and each op's path, so a figure taken on one machine can
be told from another's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmsched.executor.torch.device import cpu_bf16_matmuls, dtype_name
from llmsched.executor.torch.kernels.decode import decode_attention
from llmsched.executor.torch.kernels.library import enabled
from llmsched.executor.torch.kernels.prefill import prefill_attention_for
from llmsched.executor.torch.kernels.rms_norm import rms_norm_kernels
from llmsched.executor.torch.kernels.swiglu import swiglu_kernel

# The /proc/cpuinfo flags that decide a path, as the line names them.
FEATURES = (("avx2", "AVX2"), ("fma", "FMA"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"))
AMX_FLAGS = ("amx_tile", "amx_bf16")


def cpu_features(cpuinfo: str | None = None) -> list[str]:
    """The path-deciding features this CPU's first ``flags`` line lists (AMX when it has tiles and bf16)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    line = next((x for x in cpuinfo.splitlines() if x.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    found = [name for flag, name in FEATURES if flag in flags]
    if all(f in flags for f in AMX_FLAGS):
        found.append("AMX")
    return found


def _kernel_paths(dtype: torch.dtype) -> list[str]:
    """Each op's path for a model in ``dtype``: the C kernel where it runs, else PyTorch's."""
    bf16, f32 = dtype == torch.bfloat16, dtype == torch.float32
    prefill = prefill_attention_for(dtype)
    ops = (
        ("prefill attention", prefill is not None),
        ("decode attention", bf16 and decode_attention() is not None),
        ("RMSNorm", bf16 and rms_norm_kernels() is not None),
        ("SwiGLU", f32 and swiglu_kernel() is not None),
    )
    return [f"{op} {'C kernel' if ok else 'PyTorch'}" for op, ok in ops]


def describe(dtype: torch.dtype) -> str:
    """The start-up line: this CPU's features, its matmul path and each op's kernel for ``dtype``."""
    features = ", ".join(cpu_features()) or "no AVX2"
    native = "native" if cpu_bf16_matmuls() else "emulated"
    matmuls = f"oneDNN ({native} bfloat16)" if dtype == torch.bfloat16 else "oneDNN"
    paths = _kernel_paths(dtype) if enabled() else ["C kernels off (LLMSCHED_CPU_KERNELS=0)"]
    return f"CPU path for {dtype_name(dtype)} ({features}): matmuls {matmuls}; " + "; ".join(paths)
