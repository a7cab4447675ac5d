"""The torch microbenchmarks behind the cpu profile: what each counts, and the efficiency curves."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from llmsched.sim import calibrate  # noqa: E402
from llmsched.sim.calibrate_torch import (  # noqa: E402
    QUICK,
    compute_dtype,
    efficiency_curves,
    linear_flops,
    weight_stream_bandwidth,
)


def test_the_weight_stream_counts_the_compute_dtypes_bytes():
    work, run = weight_stream_bandwidth(rows=1, hidden=64, width=32, mats=2)
    run()
    # float32 where the executor runs float32: four bytes a weight, not bfloat16's two.
    assert work == 2 * 32 * 64 * compute_dtype().itemsize


def test_linear_flops_counts_every_row():
    # Two matrices' worth of weights in the compute dtype: two matrices timed.
    work, run = linear_flops(rows=3, hidden=16, width=8, weight_bytes=2 * 16 * 8 * compute_dtype().itemsize)
    run()
    assert work == 2 * 2 * 3 * 16 * 8


def test_efficiency_curves_have_a_point_per_measured_size():
    curves, readings = efficiency_curves(1e15, calibrate.QUICK_LIMITS, QUICK)
    assert [rows for rows, _ in curves["gemm"]] == list(QUICK.gemm_rows)
    # A causal prompt of n tokens reads (n + 1) / 2 keys per query on average.
    assert [x for x, _ in curves["attention"]] == [(n + 1) / 2 for n in QUICK.attention_curve_tokens]
    assert all(0 < e <= 1 for kind in curves.values() for _, e in kind)
    assert len(readings) == len(QUICK.gemm_rows) + len(QUICK.attention_curve_tokens)


class _Kernel:
    """A stand-in prefill kernel that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return True

    def attend(self, q, k, v, scale, out) -> None:
        self.calls += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_is_timed_on_the_kernel_for_the_timed_dtype(monkeypatch, dtype):
    from llmsched.executor.torch.kernels import prefill as kernels
    from llmsched.sim import calibrate_torch

    bf16, f32 = _Kernel(), _Kernel()
    monkeypatch.setattr(calibrate_torch, "_DTYPE", dtype)
    monkeypatch.setattr(kernels, "prefill_attention", lambda: bf16)
    monkeypatch.setattr(kernels, "prefill_attention_f32", lambda: f32)
    _, run = calibrate_torch.prefill_attention_flops(tokens=8, heads=2, kv_heads=1, head_dim=16)
    run()
    # float32 runs the float32 twin, as the executor does (SDPA was timed in its place).
    assert (f32.calls, bf16.calls) == ((1, 0) if dtype == torch.float32 else (0, 1))
