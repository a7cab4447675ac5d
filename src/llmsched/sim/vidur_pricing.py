"""What the cost model says one measured Vidur op should take: the op's work, and its price.

Each row of Vidur's profiles is one kernel of one layer on one GPU; this
module gives its FLOPs and bytes (bf16, the shard one of ``tp`` GPUs holds)
and prices it either on the plain roofline (the cost model before any fit)
or with a ``KernelFit``.
"""

from __future__ import annotations

from llmsched.executor.sim.cost_model import Efficiency
from llmsched.executor.sim.hardware import HardwareProfile
from llmsched.executor.sim.kernel_fit import KernelFit
from llmsched.sim.vidur_data import ELEMENTWISE_OP_KIND, GEMM_OPS, AttnRow, CollRow, OpRow

A = 2.0  # bf16 bytes per element, as Vidur profiled


def gemm_dims(r: OpRow) -> tuple[float, float]:
    """(K, N) of a GEMM op's weight shard on one GPU."""
    hd = r.n_embd / r.n_head
    kvh = max(r.n_kv_head / r.tp, 1.0)
    if r.op == "attn_pre_proj":
        return r.n_embd, hd * (r.n_head / r.tp + 2 * kvh)
    if r.op == "attn_post_proj":
        return r.n_head * hd / r.tp, r.n_embd
    if r.op == "mlp_up_proj":
        return r.n_embd, (2 if r.gated else 1) * r.n_expanded_embd / r.tp
    if r.op == "mlp_down_proj":
        return r.n_expanded_embd / r.tp, r.n_embd
    raise ValueError(f"{r.op} is not a GEMM")


def elementwise_bytes(r: OpRow) -> float:
    """Bytes an elementwise op moves (read and write) on one GPU."""
    t, h = r.tokens, r.n_embd
    if r.op in ("input_layernorm", "post_attention_layernorm", "emb"):
        return 2 * t * h * A
    if r.op == "add":
        return 3 * t * h * A
    if r.op == "attn_rope":
        hd = h / r.n_head
        return 2 * t * hd * (r.n_head / r.tp + max(r.n_kv_head / r.tp, 1.0)) * A
    if r.op == "mlp_act":
        return t * (3 if r.gated else 2) * r.n_expanded_embd / r.tp * A
    raise ValueError(f"{r.op} is not elementwise")


def attention_work(r: AttnRow) -> tuple[float, float]:
    """(FLOPs, bytes) of one layer's attention kernel, as the cost model counts them."""
    qh = r.n_q_head / r.tp
    kvh = max(r.n_kv_head / r.tp, 1.0)
    hd = r.n_embd / r.n_q_head
    kv_tok = 2 * kvh * hd * A
    if r.prefill:
        c, k = r.chunk, r.kv_cache
        pairs = r.batch * (c * k + c * (c + 1) / 2)
        return pairs * 4 * qh * hd, r.batch * ((k + 2 * c) * kv_tok + c * 2 * qh * hd * A)
    ctx = r.batch * (r.kv_cache + 1)
    return ctx * 4 * qh * hd, ctx * kv_tok + r.batch * 2 * qh * hd * A


def prefill_parts(r: AttnRow) -> tuple[float, float, float, float]:
    """A prefill row's (cached-context FLOPs, causal FLOPs, query rows x query heads, bytes)."""
    qh = r.n_q_head / r.tp
    per_pair = 4 * qh * r.n_embd / r.n_q_head
    c = r.chunk
    _, nbytes = attention_work(r)
    return r.batch * c * r.kv_cache * per_pair, r.batch * c * (c + 1) / 2 * per_pair, r.batch * c * qh, nbytes


def roofline_seconds(r: OpRow | AttnRow | CollRow, hw: HardwareProfile, eff: Efficiency) -> float:
    """The plain roofline's price (the cost model without a kernel fit)."""
    peak, bw = hw.peak_flops_bf16, hw.mem_bandwidth * eff.memory
    if isinstance(r, CollRow):
        ring = 2.0 * (r.world - 1) / r.world
        return hw.collective_latency_s + ring * r.size * A / (hw.link_bandwidth * eff.network)
    if isinstance(r, AttnRow):
        flops, nbytes = attention_work(r)
        return max(flops / (peak * eff.attention), nbytes / bw)
    if r.op in GEMM_OPS:
        k, n = gemm_dims(r)
        flops = 2 * r.tokens * k * n
        return max(flops / (peak * eff.gemm), (k * n + r.tokens * (k + n)) * A / bw)
    return elementwise_bytes(r) / bw


def fitted_seconds(r: OpRow | AttnRow | CollRow, hw: HardwareProfile, fit: KernelFit) -> float:
    """The price with ``fit``'s efficiencies and floors."""
    peak, bw = hw.peak_flops_bf16, hw.mem_bandwidth
    if isinstance(r, CollRow):
        return fit.all_reduce_seconds(r.size * A, r.world, hw.link_bandwidth)
    if isinstance(r, AttnRow):
        if r.prefill:
            return fit.prefill_attention_seconds(*prefill_parts(r), peak, bw)
        return fit.decode_attention_seconds(r.batch, attention_work(r)[1], bw, r.kv_cache)
    if r.op in GEMM_OPS:
        k, n = gemm_dims(r)
        return fit.gemm_seconds(r.tokens, k, n, peak, bw, A, A)
    return fit.elementwise_seconds(ELEMENTWISE_OP_KIND[r.op], elementwise_bytes(r), r.tokens, bw)
