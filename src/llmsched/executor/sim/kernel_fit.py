"""Kernel times fitted to measured operator timings: what the plain roofline lacks.

A bare roofline prices a kernel at ``max(flops / peak, bytes / bandwidth)``
scaled by one efficiency per kind. Measured GPU kernels (Vidur's operator
profiles, see ``llmsched.sim.vidur_data``) depart from that in a few
regular ways, each a term here:

- GEMMs reach a compute efficiency that grows with the number of output
  elements (tokens x output width): small or narrow GEMMs leave streaming
  multiprocessors idle, which tensor parallelism's narrower shards make
  worse. It is piecewise linear in log2(output elements) between knots.
  Near the roofline ridge compute and weight streaming do not fully
  overlap, so the two terms are blended (a p-norm, ``gemm_blend``) rather
  than maxed, and every GEMM costs at least a launch floor.
- Elementwise kernels (RMSNorm, rotary embedding, activation, residual add,
  embedding lookup) stream their bytes at a fraction of HBM bandwidth that
  depends on their size (piecewise in log2(bytes): a tensor that stays in
  the L2 cache across the layer moves faster than HBM allows), plus a floor
  per kernel. A kernel that gives each token's row to one thread block
  cannot go faster than one block streams one row, so with few tokens its
  time follows the row's width, not the total bytes.
- Prefill attention's compute efficiency follows its parallelism (query
  tokens x query heads on the GPU: a short chunk leaves SMs idle), and the
  causal (query, query) pairs cost ``attn_prefill_causal`` times a cached
  (query, key) pair: the kernel computes whole tiles on the diagonal and
  masks half of them. Plus a floor.
- Decode attention streams the KV at a bandwidth that grows with the number
  of requests in the kernel (few requests occupy few SMs), piecewise in
  log2(requests), and with each request's context (a short one is a few
  blocks per thread block, paying the kernel's per-block setup and
  reduction on little data), piecewise linear in the mean context per
  request; plus a floor per kernel and a cost per request (its block-table
  walk).
- An all-reduce costs a latency plus its ring bytes over the link.

The constants are produced by ``tools/fit_vidur_profiles.py`` and live in
``fitted_kernels.py``; every price here is per kernel (one layer's op).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from llmsched.core.errors import ConfigError

# Elementwise kernel kinds, as Vidur's profiles name their ops.
ELEMENTWISE_KINDS = ("norm", "rope", "act", "add", "emb")
# The fields that are curves (lists in JSON, tuples here).
_CURVES = (
    "gemm_knots",
    "gemm_eff",
    "elementwise_knots",
    "attn_prefill_knots",
    "attn_prefill_eff",
    "decode_knots",
    "decode_ctx_knots",
)


def interp(x: float, knots: tuple[float, ...], values: tuple[float, ...]) -> float:
    """``values`` interpolated linearly in ``x`` between ``knots``, held flat beyond them."""
    if x <= knots[0]:
        return values[0]
    for i in range(1, len(knots)):
        if x <= knots[i]:
            f = (x - knots[i - 1]) / (knots[i] - knots[i - 1])
            return values[i - 1] + f * (values[i] - values[i - 1])
    return values[-1]


def interp_log2(value: float, knots: tuple[float, ...], effs: tuple[float, ...]) -> float:
    """``effs`` interpolated linearly in log2(value) between ``knots``, held flat beyond them."""
    return interp(math.log2(value) if value > 1 else 0.0, knots, effs)


@dataclass(frozen=True, slots=True)
class KernelFit:
    """Fitted efficiencies and floors of one GPU's kernels (all seconds per kernel)."""

    # GEMM compute efficiency at log2(output elements) = gemm_knots[i].
    gemm_knots: tuple[float, ...]
    gemm_eff: tuple[float, ...]
    gemm_mem_eff: float
    gemm_blend: float
    gemm_floor_s: float
    # Per elementwise kind: (floor seconds, one row's bytes/s, then the
    # fraction of HBM bandwidth at log2(bytes) = elementwise_knots[i]).
    elementwise_knots: tuple[float, ...]
    elementwise: dict
    # Prefill attention's fraction of the bf16 peak at log2(query tokens x
    # query heads per GPU) = attn_prefill_knots[i]; a causal pair's cost in
    # cached pairs.
    attn_prefill_knots: tuple[float, ...]
    attn_prefill_eff: tuple[float, ...]
    attn_prefill_causal: float
    attn_prefill_floor_s: float
    # Decode attention's fraction of HBM bandwidth: row i at log2(requests) =
    # decode_knots[i], column j at a mean context per request of
    # decode_ctx_knots[j] tokens (interpolated linearly in the context, held
    # flat beyond the ends).
    decode_knots: tuple[float, ...]
    decode_ctx_knots: tuple[float, ...]
    decode_kv_eff: tuple[tuple[float, ...], ...]
    decode_floor_s: float
    decode_request_s: float
    all_reduce_latency_s: float
    all_reduce_eff: float
    # Where the constants came from (data set, method), for reports.
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.gemm_knots) != len(self.gemm_eff) or not self.gemm_knots:
            raise ConfigError("kernel fit: gemm_knots and gemm_eff need the same, non-zero length")
        curves = {
            "attn_prefill": (self.attn_prefill_knots, self.attn_prefill_eff),
            "decode": (self.decode_knots, self.decode_kv_eff),
        }
        for i, row in enumerate(self.decode_kv_eff):
            curves[f"decode row {i}"] = (self.decode_ctx_knots, row)
        missing = set(ELEMENTWISE_KINDS) - set(self.elementwise)
        if missing:
            raise ConfigError(f"kernel fit: elementwise kinds missing: {sorted(missing)}")
        for kind, (floor, row_rate, *effs) in self.elementwise.items():
            curves[f"elementwise {kind}"] = (self.elementwise_knots, tuple(effs))
            if floor < 0 or row_rate <= 0:
                raise ConfigError(f"kernel fit: elementwise {kind} needs floor >= 0 and a positive row rate")
        for name, (knots, effs) in curves.items():
            if len(knots) != len(effs) or not knots:
                raise ConfigError(f"kernel fit: {name} needs as many efficiencies as knots (and some)")
            if list(knots) != sorted(knots):
                raise ConfigError(f"kernel fit: {name} knots {knots} must be increasing")
        effs = [*self.gemm_eff, self.gemm_mem_eff, *self.attn_prefill_eff, self.all_reduce_eff]
        if any(not 0.0 < e <= 1.5 for e in effs):
            raise ConfigError(f"kernel fit: compute and link efficiencies must be in (0, 1.5]: {effs}")
        # Bandwidth fractions above 1 are real: a tensor the L2 cache holds
        # streams faster than HBM.
        decode = [e for row in self.decode_kv_eff for e in row]
        streams = [*decode, *(e for _, _, *es in self.elementwise.values() for e in es)]
        if any(not 0.0 < e <= 4.0 for e in streams):
            raise ConfigError(f"kernel fit: bandwidth fractions must be in (0, 4]: {streams}")
        if self.attn_prefill_causal < 1.0:
            raise ConfigError(f"kernel fit: attn_prefill_causal={self.attn_prefill_causal} must be >= 1")
        if self.gemm_blend < 1.0:
            raise ConfigError(f"kernel fit: gemm_blend={self.gemm_blend} must be >= 1")

    @classmethod
    def from_dict(cls, data: dict) -> KernelFit:
        """From ``to_dict``'s form (JSON lists become tuples); names unknown keys."""
        names = set(cls.__dataclass_fields__)
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"kernel fit: unknown fields {sorted(unknown)}")
        d = dict(data)
        if "decode_ctx_knots" not in d and "decode_kv_eff" in d:
            # A fit from before the context dimension: one column, every context.
            d["decode_ctx_knots"] = (0.0,)
            d["decode_kv_eff"] = [[e] for e in d["decode_kv_eff"]]
        for key in (*_CURVES, "decode_kv_eff"):
            if key not in d:
                raise ConfigError(f"kernel fit: missing field {key!r} (a fit of an older format: refit it)")
        for key in _CURVES:
            d[key] = tuple(d[key])
        d["decode_kv_eff"] = tuple(tuple(row) for row in d["decode_kv_eff"])
        d["elementwise"] = {k: tuple(v) for k, v in d["elementwise"].items()}
        return cls(**d)

    def to_dict(self) -> dict:
        """Plain-dict form (JSON profiles, the generated constants)."""
        d = asdict(self)
        for key in _CURVES:
            d[key] = list(d[key])
        d["decode_kv_eff"] = [list(row) for row in self.decode_kv_eff]
        d["elementwise"] = {k: list(v) for k, v in self.elementwise.items()}
        return d

    # ---- prices ----------------------------------------------------------------

    def gemm_efficiency(self, out_elements: float) -> float:
        """Compute efficiency of a GEMM writing ``out_elements`` (tokens x width), interpolated."""
        return interp_log2(out_elements, self.gemm_knots, self.gemm_eff)

    def gemm_seconds(
        self, tokens: float, k: float, n: float, peak: float, bandwidth: float, wbytes: float, abytes: float
    ) -> float:
        """One (tokens x k) @ (k x n) GEMM: blended compute and streaming time, plus the floor."""
        if tokens <= 0:
            return 0.0
        tc = 2.0 * tokens * k * n / (peak * self.gemm_efficiency(tokens * n))
        tm = (k * n * wbytes + tokens * (k + n) * abytes) / (bandwidth * self.gemm_mem_eff)
        p = self.gemm_blend
        hi = tc if tc > tm else tm
        lo = tc if tc <= tm else tm
        # (tc^p + tm^p)^(1/p), written to stay finite for large p.
        return self.gemm_floor_s + hi * (1.0 + (lo / hi) ** p) ** (1.0 / p)

    def elementwise_seconds(self, kind: str, nbytes: float, tokens: float, bandwidth: float) -> float:
        """One elementwise kernel of ``kind`` moving ``nbytes`` over ``tokens`` rows."""
        floor, row_rate, *effs = self.elementwise[kind]
        t_all = nbytes / (bandwidth * interp_log2(nbytes, self.elementwise_knots, effs))
        t_row = nbytes / (tokens * row_rate) if tokens > 0 else 0.0
        return floor + (t_all if t_all > t_row else t_row)

    def prefill_attention_seconds(
        self,
        ctx_flops: float,
        causal_flops: float,
        parallel: float,
        nbytes: float,
        peak: float,
        bandwidth: float,
    ) -> float:
        """One layer's prefill attention: cached-context and causal FLOPs over ``parallel`` query rows."""
        eff = interp_log2(parallel, self.attn_prefill_knots, self.attn_prefill_eff)
        tc = (ctx_flops + self.attn_prefill_causal * causal_flops) / (peak * eff)
        tm = nbytes / bandwidth
        return self.attn_prefill_floor_s + (tc if tc > tm else tm)

    def decode_kv_rates(self, bandwidth: float, num_decodes: int) -> tuple[float, ...]:
        """Bytes/s at which a decode kernel of ``num_decodes`` requests streams the KV, per context knot."""
        columns = zip(*self.decode_kv_eff, strict=True)
        return tuple(bandwidth * interp_log2(num_decodes, self.decode_knots, col) for col in columns)

    def decode_kv_bandwidth(self, bandwidth: float, num_decodes: int, context: float) -> float:
        """Bytes/s at which ``num_decodes`` requests of ``context`` tokens each stream their KV."""
        return interp(context, self.decode_ctx_knots, self.decode_kv_rates(bandwidth, num_decodes))

    def decode_attention_seconds(
        self, num_decodes: int, kv_bytes: float, bandwidth: float, context: float
    ) -> float:
        """One layer's decode attention kernel: ``kv_bytes`` of cached KV, ``context`` tokens a request."""
        return (
            self.decode_floor_s
            + num_decodes * self.decode_request_s
            + kv_bytes / self.decode_kv_bandwidth(bandwidth, num_decodes, context)
        )

    def all_reduce_seconds(self, nbytes: float, world: int, link_bandwidth: float) -> float:
        """One ring all-reduce of ``nbytes`` per rank over ``world`` GPUs."""
        if world <= 1:
            return 0.0
        ring = 2.0 * (world - 1) / world
        return self.all_reduce_latency_s + ring * nbytes / (link_bandwidth * self.all_reduce_eff)
