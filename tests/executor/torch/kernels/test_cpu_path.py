"""The start-up line naming the CPU path: the processor's features and each op's kernel, as chosen here."""

from __future__ import annotations

import pytest
import torch

from llmsched.executor.torch.kernels import cpu_path

ZEN4 = "model name\t: AMD EPYC 9654\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512vl\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
AVX2_ONLY = "flags\t\t: sse4_2 avx avx2 fma\nflags\t\t: avx512f\n"


@pytest.mark.parametrize(
    "cpuinfo, expected",
    [
        (ZEN4, ["AVX2", "FMA", "AVX-512", "AVX-512 BF16"]),
        (SAPPHIRE_RAPIDS, ["AVX2", "FMA", "AVX-512", "AVX-512 BF16", "AMX"]),
        # Only the first flags line (the first core) counts.
        (AVX2_ONLY, ["AVX2", "FMA"]),
        ("model name\t: something\n", []),
    ],
)
def test_features_come_from_the_first_flags_line(cpuinfo, expected):
    assert cpu_path.cpu_features(cpuinfo) == expected


def test_the_line_names_each_ops_kernel_as_this_machine_runs_it(kernels_built):
    from llmsched.executor.torch import kernels

    f32 = cpu_path.describe(torch.float32)
    has_f32 = kernels.prefill_attention_f32() is not None
    assert f"prefill attention {'C kernel' if has_f32 else 'PyTorch'}" in f32
    assert "decode attention PyTorch" in f32  # the decode kernels are bfloat16 only
    bf16 = cpu_path.describe(torch.bfloat16)
    assert "decode attention C kernel" in bf16
    assert "SwiGLU PyTorch" in bf16  # the SwiGLU kernel is float32 only
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert ("native bfloat16" if native else "emulated bfloat16") in bf16


def test_kernels_switched_off_are_named(monkeypatch):
    monkeypatch.setenv("LLMSCHED_CPU_KERNELS", "0")
    line = cpu_path.describe(torch.float32)
    assert "C kernels off (LLMSCHED_CPU_KERNELS=0)" in line
    assert "C kernel;" not in line
