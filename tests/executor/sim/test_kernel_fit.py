"""The decode KV rate's grid (request count x context per request), as the fit and the cost model read it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.cost_model import CostModel
from llmsched.executor.sim.hardware import load_hardware
from llmsched.executor.sim.kernel_fit import KernelFit
from llmsched.executor.sim.model_shapes import load_model

BW = 2e12
# Rows: 1 and 16 requests; columns: 256, 1024 and 4096 tokens a request.
GRID = {"decode_knots": [0.0, 4.0], "decode_ctx_knots": [256.0, 1024.0, 4096.0]}
GRID["decode_kv_eff"] = [[0.2, 0.5, 0.6], [0.4, 0.8, 0.9]]


def _fit(**changes) -> KernelFit:
    data = dict(load_hardware("a100").kernel_fit, **GRID)
    data.update(changes)
    return KernelFit.from_dict(data)


def test_the_rate_is_the_grid_at_its_knots_linear_between_and_flat_beyond():
    fit = _fit()
    assert fit.decode_kv_bandwidth(BW, 1, 1024) == pytest.approx(0.5 * BW)
    assert fit.decode_kv_bandwidth(BW, 16, 4096) == pytest.approx(0.9 * BW)
    # Halfway between 256 and 1024 tokens; halfway in log2 between 1 and 16 requests.
    assert fit.decode_kv_bandwidth(BW, 1, 640) == pytest.approx(0.35 * BW)
    assert fit.decode_kv_bandwidth(BW, 4, 1024) == pytest.approx(0.65 * BW)
    assert fit.decode_kv_bandwidth(BW, 1, 32) == fit.decode_kv_bandwidth(BW, 1, 256)
    assert fit.decode_kv_bandwidth(BW, 64, 9000) == pytest.approx(0.9 * BW)


def test_a_fit_without_the_context_dimension_prices_every_context_alike():
    data = dict(load_hardware("a100").kernel_fit, decode_knots=[0.0, 4.0], decode_kv_eff=[0.3, 0.7])
    data.pop("decode_ctx_knots", None)
    fit = KernelFit.from_dict(data)
    assert (
        fit.decode_kv_bandwidth(BW, 1, 50) == fit.decode_kv_bandwidth(BW, 1, 5000) == pytest.approx(0.3 * BW)
    )
    assert KernelFit.from_dict(fit.to_dict()) == fit


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"decode_kv_eff": [[0.2, 0.5], [0.4, 0.8, 0.9]]}, "decode row 0"),
        ({"decode_ctx_knots": [1024.0, 256.0, 4096.0]}, "must be increasing"),
        ({"decode_kv_eff": [[0.2, 0.5, 0.6]]}, "decode needs"),
        ({"decode_kv_eff": [[0.2, 0.5, 0.6], [0.4, 0.8, 9.0]]}, "bandwidth fractions"),
    ],
)
def test_a_bad_grid_is_named(changes, named):
    with pytest.raises(ConfigError, match=named):
        _fit(**changes)


def test_a_fit_without_its_decode_grid_names_the_missing_field():
    data = dict(load_hardware("a100").kernel_fit, **GRID)
    data.pop("decode_kv_eff")
    with pytest.raises(ConfigError, match="missing field 'decode_kv_eff'"):
        KernelFit.from_dict(data)


@pytest.mark.parametrize("d", [1, 3, 16, 100])
def test_the_cost_models_pieces_follow_the_fit_by_summed_context(d):
    hw = replace(load_hardware("a100"), kernel_fit=_fit().to_dict())
    cm, fit = CostModel(load_model("llama-3-8b"), hw), _fit()
    for per_request in (10, 256, 300, 1000, 1024, 2000, 4096, 5000):
        expected = fit.decode_kv_bandwidth(hw.mem_bandwidth, d, per_request)
        assert cm.kv_rate(d, d * per_request) == pytest.approx(expected, rel=1e-12)
    # Longer contexts read faster here, so a step's attention grows less than its KV.
    short, long = cm.kv_rate(d, d * 300), cm.kv_rate(d, d * 3000)
    assert long > short


def test_a_roofline_profile_reads_the_kv_at_one_rate():
    cm = CostModel(load_model("llama-3-8b"), load_hardware("h100-roofline"))
    assert cm.kv_pieces(8) is None
    assert cm.kv_rate(8, 80) == cm.kv_rate(8, 80_000) == cm.kv_read_rate
