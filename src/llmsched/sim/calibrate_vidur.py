"""Fitting ``KernelFit`` constants to Vidur's measured operator medians, and checking them left out.

Every term is fitted by coordinate descent in log space on the mean
absolute log error (the fidelity report's figure is the absolute relative
error, which that tracks and which no single slow kernel can dominate).
The fit is deterministic: the same rows give the same constants.

Needs numpy (the ``sim`` extra brings it, through matplotlib).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmsched.executor.sim.hardware import HardwareProfile
from llmsched.executor.sim.kernel_fit import ELEMENTWISE_KINDS, KernelFit
from llmsched.sim.vidur_data import ELEMENTWISE_OP_KIND, GEMM_OPS, AttnRow, CollRow, OpRow, VidurData
from llmsched.sim.vidur_pricing import A, attention_work, elementwise_bytes, gemm_dims, prefill_parts

# GEMM efficiency knots in log2(output elements): from one token of a narrow
# shard (~2^10) to 32k tokens of a wide one (~2^31).
GEMM_KNOTS = (10.0, 13.0, 16.0, 19.0, 22.0, 25.0, 28.0, 31.0)
# The profile each GPU's MLP-side ops are fitted to (see docs/performance/simulator.md
# for why H100's later re-profile is the one trusted).
# Elementwise bandwidth knots in log2(bytes): 256 KiB (row-bound below) to
# 1 GiB; A100's 40 MB L2 sits between the middle two.
ELEMENTWISE_KNOTS = (18.0, 22.0, 26.0, 30.0)
# Prefill attention efficiency knots in log2(query tokens x query heads per
# GPU): a 128-token chunk of 32 heads (2^12) to 8k tokens (2^18).
PREFILL_KNOTS = (12.0, 14.0, 16.0, 18.0)
# Decode attention bandwidth knots in log2(requests in the kernel): 1 to 128;
# and in the mean context per request (tokens, linear): Vidur's decode rows
# run 32 to 4k tokens, and the rate climbs steeply over the first thousand.
DECODE_KNOTS = (0.0, 2.0, 4.0, 6.0, 7.0)
DECODE_CTX_KNOTS = (256.0, 1024.0, 4096.0)
TRUSTED_VERSION = {"a100": "7d47513", "h100": "7d47513"}


def _np():
    import numpy as np

    return np


def minimize(loss: Callable, x0: Sequence[float], lo: Sequence[float], hi: Sequence[float]) -> list[float]:
    """Coordinate descent on positive parameters, each searched on a shrinking log grid."""
    np = _np()
    x = np.array(x0, dtype=float)
    best = loss(x)
    for step in (1.0, 0.5, 0.25, 0.12, 0.06, 0.03, 0.015):
        for _ in range(2):
            for i in range(len(x)):
                cands = np.clip(x[i] * np.exp(step * np.linspace(-1, 1, 15)), lo[i], hi[i])
                for c in cands:
                    y = x.copy()
                    y[i] = c
                    v = loss(y)
                    if v < best:
                        best, x = v, y
    return [float(v) for v in x]


def _log_err(np, pred, meas):
    return np.abs(np.log(pred / meas))


@dataclass
class _Gemm:
    """Column arrays of GEMM rows."""

    t: object
    k: object
    n: object
    y: object


def _gemm_arrays(rows: Sequence[OpRow]) -> _Gemm:
    np = _np()
    dims = [gemm_dims(r) for r in rows]
    return _Gemm(
        np.array([r.tokens for r in rows], float),
        np.array([d[0] for d in dims], float),
        np.array([d[1] for d in dims], float),
        np.array([r.median_ms * 1e-3 for r in rows], float),
    )


def _gemm_pred(np, g: _Gemm, x, peak: float, bw: float):
    effs = x[: len(GEMM_KNOTS)]
    mem_eff, blend, floor = x[len(GEMM_KNOTS) :]
    e = np.interp(np.log2(np.maximum(g.t * g.n, 1.0)), GEMM_KNOTS, effs)
    tc = 2 * g.t * g.k * g.n / (peak * e)
    tm = (g.k * g.n * A + g.t * (g.k + g.n) * A) / (bw * mem_eff)
    hi, lo = np.maximum(tc, tm), np.minimum(tc, tm)
    return floor + hi * (1 + (lo / hi) ** blend) ** (1 / blend)


def fit_gemm(rows: Sequence[OpRow], hw: HardwareProfile) -> dict:
    """GEMM efficiency knots, streaming efficiency, blend and floor."""
    np = _np()
    g = _gemm_arrays(rows)
    peak, bw = hw.peak_flops_bf16, hw.mem_bandwidth

    def loss(x):
        return float(np.mean(_log_err(np, _gemm_pred(np, g, x, peak, bw), g.y)))

    nk = len(GEMM_KNOTS)
    x = minimize(
        loss,
        [0.5] * nk + [0.8, 4.0, 5e-6],
        [0.01] * nk + [0.2, 1.0, 1e-7],
        [1.0] * nk + [1.0, 30.0, 1e-4],
    )
    return {
        "gemm_knots": GEMM_KNOTS,
        "gemm_eff": tuple(x[:nk]),
        "gemm_mem_eff": x[nk],
        "gemm_blend": x[nk + 1],
        "gemm_floor_s": x[nk + 2],
    }


def fit_elementwise(rows: Sequence[OpRow], hw: HardwareProfile) -> dict:
    """Per elementwise kind: (floor, one row's bytes/s, bandwidth fraction per size knot)."""
    np = _np()
    out = {}
    bw, nk = hw.mem_bandwidth, len(ELEMENTWISE_KNOTS)
    for kind in ELEMENTWISE_KINDS:
        sel = [r for r in rows if ELEMENTWISE_OP_KIND.get(r.op) == kind]
        if not sel:
            out[kind] = (0.0, 1e12, *([0.8] * nk))
            continue
        b = np.array([elementwise_bytes(r) for r in sel])
        rb = b / np.array([r.tokens for r in sel], float)
        y = np.array([r.median_ms * 1e-3 for r in sel])
        lb = np.log2(b)

        def loss(x, b=b, rb=rb, y=y, lb=lb):
            e = np.interp(lb, ELEMENTWISE_KNOTS, x[2:])
            return float(np.mean(_log_err(np, x[0] + np.maximum(b / (bw * e), rb / x[1]), y)))

        lo, hi = [1e-7, 1e8, *([0.05] * nk)], [1e-4, 1e13, *([3.0] * nk)]
        out[kind] = tuple(minimize(loss, [3e-6, 1e10, *([0.7] * nk)], lo, hi))
    return {"elementwise_knots": ELEMENTWISE_KNOTS, "elementwise": out}


def _fit_prefill(rows: Sequence[AttnRow], hw: HardwareProfile) -> dict:
    """Prefill efficiency by parallelism, the causal pairs' relative cost, and the floor."""
    np = _np()
    peak, bw = hw.peak_flops_bf16, hw.mem_bandwidth
    w = np.array([prefill_parts(r) for r in rows])
    y = np.array([r.median_ms * 1e-3 for r in rows])
    lp = np.log2(w[:, 2])
    nk = len(PREFILL_KNOTS)

    def loss(x):
        e = np.interp(lp, PREFILL_KNOTS, x[:nk])
        tc = (w[:, 0] + x[nk] * w[:, 1]) / (peak * e)
        return float(np.mean(_log_err(np, x[nk + 1] + np.maximum(tc, w[:, 3] / bw), y)))

    x = minimize(loss, [0.5] * nk + [1.5, 5e-6], [0.02] * nk + [1.0, 1e-7], [1.0] * nk + [4.0, 1e-4])
    return {
        "attn_prefill_knots": PREFILL_KNOTS,
        "attn_prefill_eff": tuple(x[:nk]),
        "attn_prefill_causal": x[nk],
        "attn_prefill_floor_s": x[nk + 1],
    }


def _grid_weights(np, values, knots: Sequence[float]):
    """Per value, each knot's linear-interpolation weight (flat beyond the ends): shape (values, knots)."""
    w = np.zeros((len(values), len(knots)))
    for j in range(len(knots)):
        unit = np.zeros(len(knots))
        unit[j] = 1.0
        w[:, j] = np.interp(values, knots, unit)
    return w


def _fit_decode(rows: Sequence[AttnRow], hw: HardwareProfile) -> dict:
    """Decode KV bandwidth on a grid of request count and context per request, floor and per-request cost."""
    np = _np()
    bw = hw.mem_bandwidth
    nb = np.array([attention_work(r)[1] for r in rows])
    b = np.array([r.batch for r in rows], float)
    y = np.array([r.median_ms * 1e-3 for r in rows])
    # The grid is interpolated in log2(requests) and linearly in context,
    # as KernelFit.decode_kv_bandwidth does: a bilinear weight per cell.
    wb = _grid_weights(np, np.log2(b), DECODE_KNOTS)
    wc = _grid_weights(np, np.array([r.kv_cache for r in rows], float), DECODE_CTX_KNOTS)
    weights = (wb[:, :, None] * wc[:, None, :]).reshape(len(rows), -1)
    nk = weights.shape[1]

    def loss(x):
        e = weights @ x[:nk]
        return float(np.mean(_log_err(np, x[nk] + b * x[nk + 1] + nb / (bw * e), y)))

    x = minimize(loss, [0.7] * nk + [1e-5, 1e-7], [0.05] * nk + [1e-7, 1e-9], [2.0] * nk + [1e-4, 1e-5])
    nc = len(DECODE_CTX_KNOTS)
    return {
        "decode_knots": DECODE_KNOTS,
        "decode_ctx_knots": DECODE_CTX_KNOTS,
        "decode_kv_eff": tuple(tuple(x[i * nc : (i + 1) * nc]) for i in range(len(DECODE_KNOTS))),
        "decode_floor_s": x[nk],
        "decode_request_s": x[nk + 1],
    }


def fit_attention(rows: Sequence[AttnRow], hw: HardwareProfile) -> dict:
    """The prefill and decode kernels' terms, from whichever of the two the rows hold."""
    pre = [r for r in rows if r.prefill]
    dec = [r for r in rows if not r.prefill]
    out: dict = {}
    if pre:
        out.update(_fit_prefill(pre, hw))
    if dec:
        out.update(_fit_decode(dec, hw))
    return out


def fit_all_reduce(rows: Sequence[CollRow], hw: HardwareProfile) -> dict:
    """All-reduce latency and link efficiency."""
    np = _np()
    # Within one 8-GPU node: what tensor parallelism runs on.
    rows = [r for r in rows if r.collective == "all_reduce" and 1 < r.world <= 8]
    if not rows:
        return {}
    ring = np.array([2.0 * (r.world - 1) / r.world * r.size * A for r in rows])
    y = np.array([r.median_ms * 1e-3 for r in rows])

    def loss(x):
        return float(np.mean(_log_err(np, x[0] + ring / (hw.link_bandwidth * x[1]), y)))

    lat, eff = minimize(loss, [1e-5, 0.7], [1e-7, 0.05], [2e-4, 1.5])
    return {"all_reduce_latency_s": lat, "all_reduce_eff": eff}


# The plain roofline's terms, where a GPU has no GEMM measurements.
DEFAULT_GEMM = {
    "gemm_knots": (20.0,),
    "gemm_eff": (0.7,),
    "gemm_mem_eff": 0.8,
    "gemm_blend": 30.0,
    "gemm_floor_s": 0.0,
}
# Used where a GPU has no measurement of a kind (H100 attention): A100's fit.
DEFAULT_ATTENTION = {
    "attn_prefill_knots": (12.0,),
    "attn_prefill_eff": (0.5,),
    "attn_prefill_causal": 1.0,
    "attn_prefill_floor_s": 0.0,
    "decode_knots": (0.0,),
    "decode_ctx_knots": (0.0,),
    "decode_kv_eff": ((0.8,),),
    "decode_floor_s": 0.0,
    "decode_request_s": 0.0,
}


def fit_kernels(
    ops: Sequence[OpRow],
    attention: Sequence[AttnRow],
    collectives: Sequence[CollRow],
    hw: HardwareProfile,
    attention_fallback: dict | None = None,
    source: str = "",
) -> KernelFit:
    """A ``KernelFit`` for ``hw`` from its rows (attention from ``attention_fallback`` if none)."""
    gemms = [r for r in ops if r.op in GEMM_OPS]
    d: dict = dict(DEFAULT_GEMM)
    if gemms:
        d.update(fit_gemm(gemms, hw))
    d.update(fit_elementwise([r for r in ops if r.op not in GEMM_OPS], hw))
    d.update(attention_fallback or DEFAULT_ATTENTION)
    d.update(fit_attention(attention, hw))
    d.update({"all_reduce_latency_s": hw.collective_latency_s, "all_reduce_eff": 0.7})
    d.update(fit_all_reduce(collectives, hw))
    d["source"] = source
    return KernelFit.from_dict(d)


def rows_for(data: VidurData, gpu: str) -> tuple[list[OpRow], list[AttnRow], list[CollRow]]:
    """The rows a GPU's fit uses: its trusted MLP-side profile, all its attention, its all-reduces."""
    version = TRUSTED_VERSION.get(gpu)
    ops = [r for r in data.ops if r.gpu == gpu and (version is None or r.version == version)]
    attn = [r for r in data.attention if r.gpu == gpu]
    coll = [r for r in data.collectives if r.gpu == gpu and r.collective == "all_reduce"]
    if any(r.version == version for r in coll):
        coll = [r for r in coll if r.version == version and r.topology in ("dgx", "node")]
    return ops, attn, coll


def leave_one_shape_out(ops: Sequence[OpRow], hw: HardwareProfile) -> list[tuple[OpRow, float]]:
    """Each model shape's rows priced by a fit of every other shape's rows: (row, predicted seconds)."""
    from llmsched.sim.vidur_pricing import fitted_seconds

    out: list[tuple[OpRow, float]] = []
    for shape in sorted({r.shape for r in ops}):
        train = [r for r in ops if r.shape != shape]
        fit = fit_kernels(train, [], [], hw)
        out += [(r, fitted_seconds(r, hw, fit)) for r in ops if r.shape == shape]
    return out


def leave_one_band_out(
    attention: Sequence[AttnRow], hw: HardwareProfile, bands: int = 5
) -> list[tuple[AttnRow, float]]:
    """Attention rows priced by a fit without their context band (the data hold one head shape)."""
    from llmsched.sim.vidur_pricing import fitted_seconds

    sizes = sorted({r.kv_cache for r in attention})
    band = {k: i * bands // len(sizes) for i, k in enumerate(sizes)}
    out: list[tuple[AttnRow, float]] = []
    for b in range(bands):
        train = [r for r in attention if band[r.kv_cache] != b]
        fit = fit_kernels([], train, [], hw) if train else None
        out += [(r, fitted_seconds(r, hw, fit)) for r in attention if band[r.kv_cache] == b and fit]
    return out
