"""The torch microbenchmarks behind the cpu profile: what each counts, and the efficiency curves."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from llmsched.executor.sim.cost_model import BatchShape, CostModel  # noqa: E402
from llmsched.executor.sim.model_shapes import load_model  # noqa: E402
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
    work, run = linear_flops(rows=3, hidden=16, width=8, mats=2)
    run()
    assert work == 2 * 2 * 3 * 16 * 8


def test_efficiency_curves_have_a_point_per_measured_size():
    curves, readings = efficiency_curves(1e15, calibrate.QUICK_LIMITS, QUICK)
    assert [rows for rows, _ in curves["gemm"]] == list(QUICK.gemm_rows)
    # A causal prompt of n tokens reads (n + 1) / 2 keys per query on average.
    assert [x for x, _ in curves["attention"]] == [(n + 1) / 2 for n in QUICK.attention_curve_tokens]
    assert all(0 < e <= 1 for kind in curves.values() for _, e in kind)
    assert len(readings) == len(QUICK.gemm_rows) + len(QUICK.attention_curve_tokens)


def test_the_cpu_profile_prices_linears_by_the_measured_curve():
    c = {
        "backend": "torch",
        "peak_flops": 1e11,
        "mem_bandwidth": 1e14,
        "mem_capacity": 16.0 * 2**30,
        "memory_efficiency": 1.0,
        "attention_efficiency": 0.5,
        "efficiency_curves": {"gemm": [[1, 0.1], [2048, 1.0]], "attention": [[128.5, 0.5]]},
    }
    cm = CostModel(load_model("llama-3-8b"), calibrate.profile_from_calibration(c))
    one = {op.name: op for op in cm.ops(BatchShape.from_chunks([(0, 1)], num_sampled=1))}["mlp"]
    big = {op.name: op for op in cm.ops(BatchShape.from_chunks([(0, 2048)], num_sampled=1))}["mlp"]
    # A one-row step's linears at a tenth of the peak, a 2048-row prefill's at all of it.
    assert one.seconds == pytest.approx(one.flops / (0.1 * 1e11), rel=1e-9)
    assert big.seconds == pytest.approx(big.flops / 1e11, rel=1e-9)
