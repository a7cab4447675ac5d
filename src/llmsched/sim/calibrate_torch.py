"""Microbenchmarks of what a plain-PyTorch LLM step does on a CPU, for the ``cpu`` profile.

A CPU runs a model eagerly, op by op, on the cores that also run Python, so
besides the matmul peak and the memory bandwidth three things decide its
step time, and each is measured here in the dtype the torch executor's
``auto`` runs a model in on this CPU (``compute_dtype``: bfloat16 where the
CPU has bfloat16 matmuls, float32 elsewhere) with the threads torch will use:

- prefill attention: a causal attention (the C kernel where the executor
  runs it, else ``scaled_dot_product_attention``) over a 1024
  token prompt reaches a fraction of the matmul peak (it is not one
  big GEMM); that fraction becomes the attention efficiency;
- decode attention: paged KV has to be gathered from scattered blocks and
  each request's few query rows multiply against it as tiny batched
  matmuls, so decodes stream the KV cache well below the copy bandwidth;
  the KV bytes per second of a gather + baddbmm + softmax + bmm decode is
  the profile's decode KV bandwidth;
- weight streaming: a decode step's linears have a few rows, so they
  stream their weights, at a measured fraction of the copy bandwidth (the
  profile's memory efficiency);
- host overhead: one decoder layer of a small batch issues a few dozen ops,
  each costing microseconds of Python and dispatch; a Llama-style layer at
  toy sizes (so its arithmetic is negligible) measures that per layer.

The last two are stand-ins: ``calibrate_executor`` measures both (and the
per-step and per-request host costs) on the executor's real code path, and
the calibration uses these only when that probe cannot run.

Each figure is timed until its readings settle and agree, in a window
checked for other processes' CPU time (``settle``); the benchmarks here
only build their tensors and return the work one call does and the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmsched.executor.torch.device import cpu_bf16_matmuls, cpu_dtypes, dtype_name
from llmsched.executor.torch.kernels import prefill_attention_for
from llmsched.executor.torch.layers import can_prepack_linears, packed_linear, prepack_linear
from llmsched.sim.settle import Limits, Reading, measure


def compute_dtype() -> torch.dtype:
    """The dtype the torch executor's ``auto`` runs a bfloat16 or float32 checkpoint in on this CPU."""
    # Timing bfloat16 on a CPU without bfloat16 matmuls would describe an
    # emulation several times slower than what the executor runs by default.
    return cpu_dtypes(cpu_bf16_matmuls())[0]


_DTYPE = compute_dtype()
# Gathered K and V of one decode group: about a core's L2 cache.
_GATHER_BYTES = 1 << 20

# (work per call, the call): the figure is work / seconds per call.
Bench = tuple[float, Callable[[], object]]


@dataclass(frozen=True, slots=True)
class Sizes:
    """Problem sizes of the microbenchmarks (``QUICK`` for tests: seconds, not tens)."""

    matmul_n: int = 1024
    copy_bytes: int = 128 << 20
    stream_hidden: int = 2048
    stream_width: int = 4096
    attention_tokens: int = 1024
    decode_seqs: int = 32
    decode_context: int = 512
    # Rows of the timed linears and prompt lengths of the timed prefill
    # attention: the points of the size-dependent efficiency curves. Every
    # row count to 8: a BLAS's small-row kernels work in tiles of a few rows,
    # so the time is not monotonic there (on the development CPU a 2- or
    # 3-row float32 linear takes longer than a 4-row one, 7 rows longer
    # than 8), and decode steps of a few requests sit on those points.
    gemm_rows: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 64, 256, 2048)
    linear_hidden: int = 1024
    linear_width: int = 4096
    linear_bytes: int = 64 << 20
    attention_curve_tokens: tuple[int, ...] = (256, 1024, 4096)
    curve_passes: int = 3


FULL = Sizes()
QUICK = Sizes(
    matmul_n=384,
    copy_bytes=16 << 20,
    stream_hidden=512,
    stream_width=1024,
    attention_tokens=256,
    decode_seqs=8,
    decode_context=128,
    gemm_rows=(1, 16, 128),
    linear_hidden=256,
    linear_width=512,
    linear_bytes=1 << 20,
    attention_curve_tokens=(64, 256),
    curve_passes=1,
)


def matmul_flops(n: int = 1024) -> Bench:
    """Dense matmul FLOPs (in the compute dtype) (square, large enough to be compute bound)."""
    a = torch.rand(n, n).to(_DTYPE)
    b = torch.rand(n, n).to(_DTYPE)

    def run() -> None:
        for _ in range(4):
            torch.mm(a, b)

    return 4 * 2 * n**3, run


def copy_bandwidth(nbytes: int = 128 << 20) -> Bench:
    """Bytes (read + write) of a tensor copy larger than the last-level cache."""
    src = torch.ones(nbytes // _DTYPE.itemsize, dtype=_DTYPE)
    dst = torch.empty_like(src)
    return 2 * nbytes, lambda: dst.copy_(src)


def weight_stream_bandwidth(rows: int = 4, hidden: int = 2048, width: int = 4096, mats: int = 4) -> Bench:
    """Weight bytes of small-batch linears (decode GEMMs) over weights larger than the caches."""
    x = torch.randn(rows, hidden).to(_DTYPE)
    ws = [torch.randn(width, hidden).to(_DTYPE) for _ in range(mats)]

    def run() -> None:
        for w in ws:
            F.linear(x, w)

    return mats * width * hidden * _DTYPE.itemsize, run


def linear_flops(rows: int, hidden: int = 1024, width: int = 4096, weight_bytes: int = 64 << 20) -> Bench:
    """FLOPs of ``rows``-row linears as the torch executor runs them (prepacked where it prepacks).

    Over ``weight_bytes`` of weights in the compute dtype, more than the
    caches hold, as a step's linears stream each layer's weights once.
    """
    mats = max(1, weight_bytes // (width * hidden * _DTYPE.itemsize))
    x = torch.randn(rows, hidden).to(_DTYPE)
    ws = [torch.randn(width, hidden).to(_DTYPE) for _ in range(mats)]
    linear = F.linear
    if can_prepack_linears(torch.device("cpu"), _DTYPE):
        ws = [prepack_linear(w) for w in ws]
        linear = packed_linear

    def run() -> None:
        for w in ws:
            linear(x, w)

    return mats * 2 * rows * hidden * width, run


def prefill_attention_flops(
    tokens: int = 1024, heads: int = 8, kv_heads: int = 4, head_dim: int = 64
) -> Bench:
    """FLOPs of causal attention over one prompt (4 x heads x head_dim per visible pair).

    Timed as the torch executor runs prefill: the C kernel for the timed
    dtype where it runs (kernels/prefill_attention.c for bfloat16,
    prefill_attention_f32.c for float32), else PyTorch's SDPA; with the
    attention core of common small models (64-wide heads, two query heads
    per KV head), whose shared K and V the kernel packs once.
    """
    pairs = tokens * (tokens + 1) / 2
    flops = 4 * heads * head_dim * pairs
    # The kernel for the timed dtype: the float32 twin where the executor runs float32.
    kernel = prefill_attention_for(_DTYPE)
    if kernel is not None and kernel.supports(_DTYPE, head_dim):
        q = torch.randn(tokens, heads, head_dim).to(_DTYPE)
        k, v = (torch.randn(tokens, kv_heads, head_dim).to(_DTYPE) for _ in range(2))
        out = torch.empty_like(q)
        return flops, lambda: kernel.attend(q, k, v, head_dim**-0.5, out)
    q = torch.randn(1, heads, tokens, head_dim).to(_DTYPE)
    k, v = (torch.randn(1, kv_heads, tokens, head_dim).to(_DTYPE) for _ in range(2))
    return flops, lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=heads != kv_heads
    )


def decode_kv_bandwidth(
    num_seqs: int = 32,
    context: int = 512,
    kv_heads: int = 4,
    group: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    layers: int = 4,
) -> Bench:
    """Cached-KV bytes of eager paged decode attention: gather blocks, then tiny batched matmuls.

    Every layer has its own cache, larger together than the last-level
    cache, with the requests spread over it, as in a serving run.
    Requests go in groups whose gathered K/V fits ``_GATHER_BYTES`` (so the
    matmuls that read it back find it in the core's cache) into one reused
    buffer (a fresh one would page-fault on every call).
    """
    per_seq = context // block_size
    pool = 4 * num_seqs * per_seq
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2 * kv_heads, pool, block_size * head_dim).to(_DTYPE) for _ in range(layers)]
    # Each request's blocks lie together (a block pool hands out free blocks
    # in order), the requests in a random order over a pool four times larger.
    starts = [torch.randperm(4 * num_seqs, generator=gen)[:num_seqs] * per_seq for _ in range(layers)]
    run_ids = torch.arange(per_seq)
    tables = [(st[:, None] + run_ids).reshape(-1) for st in starts]
    g = max(1, _GATHER_BYTES // (2 * kv_heads * context * head_dim * _DTYPE.itemsize))
    buf = torch.empty(2 * kv_heads, g * per_seq, block_size * head_dim, dtype=_DTYPE)
    qt = torch.randn(kv_heads * g, head_dim, group).to(_DTYPE)
    scale = head_dim**-0.5

    def run() -> None:
        for cache, table in zip(caches, tables):
            for s in range(0, num_seqs - g + 1, g):
                torch.index_select(cache, 1, table[s * per_seq : (s + g) * per_seq], out=buf)
                kv = buf.view(2, kv_heads * g, context, head_dim)
                # Keys times the transposed queries: no copy of the gathered K.
                scores = torch.bmm(kv[0], qt).mul_(scale)
                torch.bmm(torch.softmax(scores, dim=1).transpose(1, 2), kv[1])

    kv_bytes = layers * num_seqs * context * 2 * kv_heads * head_dim * _DTYPE.itemsize
    return kv_bytes, run


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def layer_overhead(tokens: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> Bench:
    """Twenty eager Llama-style decoder layers at toy sizes: their time is host (Python, dispatch) cost."""
    d = hidden // heads
    inter = 2 * hidden
    context = 32

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(_DTYPE)

    qkv_w, o_w = w((heads + 2 * kv_heads) * d, hidden), w(hidden, heads * d)
    gate_up_w, down_w = w(2 * inter, hidden), w(hidden, inter)
    n1, n2 = w(hidden), w(hidden)
    cos, sin = w(tokens, 1, d // 2), w(tokens, 1, d // 2)
    cache = w(2 * kv_heads, context, d)
    slots = torch.arange(context - tokens, context)
    x = w(tokens, hidden)
    grp = heads // kv_heads

    def rope(t: torch.Tensor) -> torch.Tensor:
        a, b = t[..., : d // 2], t[..., d // 2 :]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def layer() -> torch.Tensor:
        h = _rms_norm(x, n1)
        q, k, v = F.linear(h, qkv_w).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q = rope(q.view(tokens, heads, d))
        k = rope(k.view(tokens, kv_heads, d))
        cache[:kv_heads].index_copy_(1, slots, k.transpose(0, 1))
        cache[kv_heads:].index_copy_(1, slots, v.view(tokens, kv_heads, d).transpose(0, 1))
        kv = torch.index_select(cache, 1, torch.arange(context))
        qh = q.view(tokens, kv_heads, grp, d).permute(1, 0, 2, 3).reshape(kv_heads, tokens * grp, d)
        scores = torch.softmax(torch.bmm(qh, kv[:kv_heads].transpose(1, 2)) * d**-0.5, dim=-1)
        attn = torch.bmm(scores, kv[kv_heads:]).view(kv_heads, tokens, grp, d).permute(1, 0, 2, 3)
        r = x + F.linear(attn.reshape(tokens, heads * d), o_w)
        gate, up = F.linear(_rms_norm(r, n2), gate_up_w).chunk(2, dim=-1)
        return r + F.linear(F.silu(gate) * up, down_w)

    def run() -> None:
        with torch.inference_mode():
            for _ in range(20):
                layer()

    return 20.0, run


def measure_torch(limits: Limits | None = None, sizes: Sizes = FULL) -> tuple[dict, list[Reading]]:
    """The peaks and efficiencies above, keyed as the calibration stores them, and their readings."""
    limits = limits or Limits()
    peak = measure("peak_flops", *matmul_flops(sizes.matmul_n), limits)
    copy = measure("mem_bandwidth", *copy_bandwidth(sizes.copy_bytes), limits)
    stream = measure(
        "weight_stream_bandwidth",
        *weight_stream_bandwidth(hidden=sizes.stream_hidden, width=sizes.stream_width),
        limits,
    )
    attn = measure("prefill_attention_flops", *prefill_attention_flops(sizes.attention_tokens), limits)
    curves, more = efficiency_curves(peak.value, limits, sizes)
    figures = {
        "peak_flops": peak.value,
        "mem_bandwidth": copy.value,
        "memory_efficiency": min(1.0, stream.value / copy.value),
        "attention_efficiency": min(1.0, attn.value / peak.value),
        "efficiency_curves": curves,
        "dtype": dtype_name(_DTYPE),
    }
    return figures, [peak, copy, stream, attn, *more]


def efficiency_curves(peak: float, limits: Limits, sizes: Sizes) -> tuple[dict, list[Reading]]:
    """The linears' efficiency by rows and prefill attention's by keys per query, as fractions of ``peak``.

    One efficiency per kind cannot price this CPU's steps: its linears
    reach 0.6 of the matmul peak at 64 rows and about 0.9 from 256, and the
    prefill attention kernel 0.6 at 256-token prompts and 0.9 at 4096.
    Mid-sized linears move by up to a fifth between settled readings on a
    shared machine (0.68-0.94 at 256 rows), so every point is the median
    of ``sizes.curve_passes`` interleaved passes over all of them: one
    pass caught in a neighbour's burst, or in a lucky moment, does not set it.
    """
    benches = [
        (
            f"linear_flops_{rows}",
            rows,
            linear_flops(rows, sizes.linear_hidden, sizes.linear_width, sizes.linear_bytes),
        )
        for rows in sizes.gemm_rows
    ]
    # A causal prompt of n tokens: each query reads (n + 1) / 2 keys on average.
    benches += [
        (f"prefill_attention_flops_{n}", (n + 1) / 2, prefill_attention_flops(n))
        for n in sizes.attention_curve_tokens
    ]
    passes: dict[str, list[Reading]] = {name: [] for name, _, _ in benches}
    for _ in range(sizes.curve_passes):
        for name, _, bench in benches:
            passes[name].append(measure(name, *bench, limits))
    mid = {name: sorted(rs, key=lambda r: r.value)[(len(rs) - 1) // 2] for name, rs in passes.items()}
    points = [[size, min(1.0, mid[name].value / peak)] for name, size, _ in benches]
    n = len(sizes.gemm_rows)
    return {"gemm": points[:n], "attention": points[n:]}, list(mid.values())


def host_figures(limits: Limits | None = None, sizes: Sizes = FULL) -> tuple[dict, list[Reading]]:
    """Decode KV rate and per-layer host cost from single ops (when the executor probe cannot run)."""
    limits = limits or Limits()
    kv = measure("decode_kv_bandwidth", *decode_kv_bandwidth(sizes.decode_seqs, sizes.decode_context), limits)
    layers = measure("layers_per_second", *layer_overhead(), limits)
    return {"decode_kv_bandwidth": kv.value, "layer_overhead_s": 1.0 / layers.value}, [kv, layers]
