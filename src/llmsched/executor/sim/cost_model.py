"""How long one engine step takes: FLOPs and bytes per operation, on a roofline.

Every operation of a step costs ``max(flops / (peak x efficiency),
bytes / (bandwidth x efficiency))`` on one GPU; collectives cost a fixed
latency plus their bytes over the interconnect; a fixed overhead is added
per step. The batch enters only through a few sums over the scheduled
requests (``BatchShape``), so a step costs the same Python time whatever
its size. All figures are per GPU: under tensor parallelism (TP) each rank
holds 1/TP of the sharded weights and heads, and all ranks run in lockstep.

Default efficiencies (override with ``Efficiency(...)`` or ``--efficiency``):

- ``gemm`` 0.70: large bf16/fp8 GEMMs on H100-class parts reach 60-75% of the
  dense peak.
- ``attention`` 0.50: FlashAttention-2/3 prefill reaches 40-60% of the peak.
- ``memory`` 0.80: weight and KV streaming kernels reach ~80% of HBM peak.
- ``network`` 0.70: NCCL/custom all-reduce bus bandwidth over NVLink.
- ``step_overhead_s`` 0.5 ms: per-step engine work outside the kernels (input
  preparation, launch gaps, output processing) with CUDA graphs on; a
  hardware profile that measured its own (``cpu``) supplies it instead.

Host work that grows with the step (the ``cpu`` profile measures it, GPU
profiles leave it at 0): ``layer_overhead_s`` per decoder layer and
``request_overhead_s`` per scheduled request.

Kernel launches (see ``launch_mode``): vLLM replays a captured CUDA graph
for a step whose requests all decode one token and whose token count is at
most the largest capture size (``cuda_graph_max_tokens``); such a step pays
only the step overhead. A mixed step within that size replays piecewise
graphs with the attention core launched eagerly, and a larger step launches
every kernel of every layer; those launches are charged at
``launch_latency_s`` each on top of the kernels' time. Data-parallel ranks
in lock step agree on one mode per step, the lowest any rank can use.
vLLM turns graphs off altogether for data parallelism with DeepEP's
high-throughput kernels (``cuda_graph_max_tokens=0`` models that).

Host path and model time (``step_parts``): with async scheduling the engine
plans and prepares step N+1, and processes step N-1's output, while step N
runs on the device, so what a step costs depends on which of its parts
need the CPU and which the device. The split, by who does the work:

- host path, which async scheduling overlaps with the other step's model
  time: ``step_overhead_s`` (scheduling, building the inputs and attention
  metadata, replaying the graph, turning sampled ids into outputs),
  ``request_overhead_s`` per scheduled request (its rows of the inputs, its
  sampling state, its output), and the eager or piecewise kernel launches:
  a GPU runs kernels asynchronously to the thread that issues them, so
  step N+1's launches are issued while step N's kernels still run (vLLM's
  async model runner copies the sampled ids back without blocking the
  host). Within one step, launches and the kernels they launch are still
  charged in series, as in sync mode: a step's forward starts when its
  host work is done (an upper bound, as before).
- model time, which nothing overlaps: every roofline op (GEMMs, attention,
  norms, LM head, sampler), the collectives (NCCL runs on the device's
  stream), and ``layer_overhead_s``. That last one is measured only on the
  ``cpu`` profile, whose device runs each op in the thread that issues it:
  a layer's Python and operator dispatch sits between its ops on the
  forward's critical path, and async scheduling cannot hide it (GPUs
  profiles leave it at 0; their dispatch cost is the launches above).

Ops with ``bound == "overhead"`` are the host path except
``layer_overhead``. ``step_time`` is the sync price, host path plus model
time, summed op by op exactly as before the split existed; how the two parts
combine under async scheduling is the SimExecutor's business (a pipeline of
host and device, see executor.py). On the ``cpu`` profile the host path and
the model share the cores, so the overlap it predicts assumes a core free
for the engine's thread.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Protocol

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.hardware import HardwareProfile
from llmsched.executor.sim.kernel_fit import KernelFit, interp_log2
from llmsched.executor.sim.model_shapes import ModelShape

# Logits are produced in fp32 and read a few times by the sampler
# (temperature, top-k/top-p filtering, the draw itself).
_LOGIT_BYTES = 4
_SAMPLER_PASSES = 3
# Elementwise traffic per layer per token, in units of the hidden size: two
# fused residual-add + RMSNorm kernels, each reading the input and the
# residual and writing both. Every TP rank does this on the full width.
_ELEMENTWISE_HIDDEN_PASSES = 8
# Rotary embedding rewrites this rank's q and k in place (read + write).
_ROPE_PASSES = 2
# The gated activation reads gate and up and writes one: 3 passes over the
# MLP width.
_ACTIVATION_PASSES = 3

# How a step launches its kernels, ordered as vLLM's CUDAGraphMode (NONE <
# PIECEWISE < FULL): vLLM's v1/worker/dp_utils.py takes the minimum over the
# data-parallel ranks, so one rank's prefill makes every rank of the step run
# without its full graph.
LAUNCH_EAGER = 0
LAUNCH_PIECEWISE = 1
LAUNCH_GRAPH = 2
LAUNCH_MODE_NAMES = ("eager", "piecewise", "graph")

# Kernels one decoder layer launches outside CUDA graphs, counted from the
# modules vLLM runs for it (no Inductor fusion assumed). Each linear layer is
# one GEMM, or two with fp8 block-quantised weights (activation quantisation,
# then the GEMM); a TP all-reduce is one more where TP > 1.
# - Around attention: fused residual-add + RMSNorm, the projections (GQA: QKV
#   and O; MLA: fused q_a/kv_a, q_b and O), MLA's latent RMSNorms (one per
#   compressed input), rotary embedding, the all-reduce after O.
# - The attention core (what vLLM's piecewise graphs leave out): the KV-cache
#   write and the attention kernel for GQA; for MLA in a mixed step the cache
#   write, the decode path (query absorption BMM, FlashMLA, value up-projection
#   BMM), and the prefill path (kv_b projection, FlashAttention, output merge).
# - Dense MLP: RMSNorm, gate_up, SiLU-and-mul, down, all-reduce.
# - MoE MLP: RMSNorm, router GEMM, grouped top-k (2), the shared expert's
#   gate_up / activation / down, the routed experts (activation quantisation,
#   permute, two grouped GEMMs, activation, unpermute-and-reduce: 6), then
#   dispatch layout, dispatch and combine under expert parallelism (3) or the
#   TP all-reduce without it, and the add of shared and routed outputs.
# This gives 10 per layer for Llama-3-8B in bf16 on one GPU and 39 for a
# DeepSeek-V3 MoE layer in fp8 under TP 4 / EP 16; a profiler trace of the
# real deployment is the way to refine it (``kernels_per_layer`` overrides).
_GQA_CORE_KERNELS = 2
_MLA_CORE_FIXED_KERNELS = 6  # plus the kv_b linear
_TOPK_KERNELS = 2
_ROUTED_EXPERT_KERNELS = 6
_EP_EXCHANGE_KERNELS = 3
_MAMBA_CORE_KERNELS = 2


# The op recorders _ops() hands to _moe_ops(): (name, flops, bytes, rate) and (name, count, bytes).
_Roof = Callable[[str, float, float, float], None]
_Comm = Callable[[str, int, float], None]


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of the hardware peaks that real kernels reach."""

    gemm: float = 0.70
    attention: float = 0.50
    memory: float = 0.80
    network: float = 0.70

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise ConfigError(f"efficiency {f.name}={v!r} must be in (0, 1]")

    @classmethod
    def parse(cls, spec: str | Iterable[str] | None) -> Efficiency:
        """From 'gemm=0.6,memory=0.75' (or a list of such items); names the bad key."""
        return cls(**cls.overrides(spec))

    @classmethod
    def overrides(cls, spec: str | Iterable[str] | None) -> dict[str, float]:
        """The KEY=VALUE items of ``spec`` as a dict (unchecked ranges); names the bad key."""
        if not spec:
            return {}
        items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in s.split(",")]
        names = {f.name for f in fields(cls)}
        values: dict[str, float] = {}
        for item in items:
            if not item.strip():
                continue
            key, sep, val = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ConfigError(
                    f"--efficiency item {item!r}: expected KEY=VALUE with KEY in {sorted(names)}"
                )
            try:
                values[key] = float(val)
            except ValueError:
                raise ConfigError(f"--efficiency {key}={val!r} is not a number") from None
        return values


@dataclass(frozen=True, slots=True)
class Parallelism:
    """How one engine's model is split over GPUs."""

    tensor_parallel_size: int = 1
    # Experts are spread over the TP group (each GPU holds whole experts)
    # instead of every GPU holding a 1/TP slice of every expert.
    enable_expert_parallel: bool = False
    # Data-parallel ranks sharing the expert-parallel group: experts spread
    # over all DP x TP GPUs, and the expert layers see every rank's tokens.
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size={tp!r} must be a positive integer")
        dp = self.data_parallel_size
        if not isinstance(dp, int) or dp < 1:
            raise ConfigError(f"data_parallel_size={dp!r} must be a positive integer")


@dataclass(slots=True)
class BatchShape:
    """One step's batch, reduced to the sums the cost model needs.

    A request scheduled ``n`` tokens starting at position ``s`` is a decode
    when ``n == 1`` (it attends to ``s + 1`` keys) and a prefill chunk
    otherwise: it attends causally to ``n * s + n * (n + 1) / 2`` (query,
    key) pairs and reads the ``s`` cached tokens' KV once.
    """

    num_tokens: int = 0
    num_sampled: int = 0
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    prefill_context: int = 0
    num_decodes: int = 0
    decode_context: int = 0
    # Prefill chunks (requests scheduled more than one token): with the
    # decodes, the requests whose per-request host work the step pays.
    num_prefills: int = 0
    # Tokens that run a LoRA adapter, and how many distinct adapters the step runs.
    lora_tokens: int = 0
    num_loras: int = 0
    # Speculative decoding: prefill tokens that are decodes verifying drafts
    # (1 + K per request); a step of only those still replays a CUDA graph.
    spec_tokens: int = 0
    # Of prefill_pairs, the chunks' pairs among themselves (n * (n + 1) / 2
    # each): the fitted kernel prices them apart from the cached context.
    prefill_causal: int = 0

    @classmethod
    def from_chunks(cls, chunks: Iterable[tuple[int, int]], num_sampled: int) -> BatchShape:
        """From (start position, token count) per scheduled request."""
        b = cls(num_sampled=num_sampled)
        for start, n in chunks:
            b.num_tokens += n
            if n == 1:
                b.num_decodes += 1
                b.decode_context += start + 1
            else:
                b.num_prefills += 1
                b.prefill_tokens += n
                b.prefill_causal += n * (n + 1) // 2
                b.prefill_pairs += n * start + n * (n + 1) // 2
                b.prefill_context += start
        return b


@dataclass(frozen=True, slots=True)
class OpCost:
    """One operation's work and time on one GPU in one step."""

    name: str
    flops: float
    bytes: float
    comm_bytes: float
    seconds: float
    bound: str  # compute, memory, network or overhead


# Host-side overhead ops (see the module docstring): what async scheduling
# overlaps. layer_overhead is "overhead" too but runs inside the forward.
HOST_OPS = frozenset({"step_overhead", "request_overhead", "eager_launches", "piecewise_launches"})

StepParts = tuple[float, float, float]
# The ops whose time depends on the batch's context, and those _ops lists before them.
_ATTENTION_CORES = frozenset({"attention_prefill", "attention_decode"})
_BEFORE_ATTENTION = frozenset({"embedding", "attention_linears"})
# One op as _ops lists it: (name, flops, bytes, comm_bytes, seconds, bound).
_OpRow = tuple[str, float, float, float, float, str]
# The GEMMs over a layer's or the LM head's weights.
_WEIGHT_GEMMS = frozenset({"attention_linears", "mamba_linears", "mlp", "lm_head"})
# Batch shapes whose other ops' times are kept (a step's token count bounds them in practice).
_MAX_SHAPES = 1 << 16
# Per batch shape: seconds of the ops before the attention cores, (seconds, host?) of those after.
_ShapeOps = tuple[tuple[float, ...], tuple[tuple[float, bool], ...]]


def _roof_seconds(flops: float, nbytes: float, rate: float, mem: float) -> float:
    """An op's time on the roofline: its compute or its memory traffic, whichever is longer."""
    tc, tm = flops / rate, nbytes / mem
    return tc if tc > tm else tm


def _rate_curve(points: list | None, peak: float) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """An efficiency curve's (log2 sizes, FLOP/s at them), for ``_rate_at``; None for no curve."""
    if not points:
        return None
    return tuple(math.log2(x) for x, _ in points), tuple(peak * e for _, e in points)


def _rate_at(curve: tuple[tuple[float, ...], tuple[float, ...]], size: float) -> float:
    """The curve's rate at ``size``: linear in log2(size) between its points, flat beyond."""
    return interp_log2(size, *curve)


_NO_PARTS: StepParts = (0.0, 0.0, 0.0)


class StepCostModel(Protocol):
    """Anything that prices a step."""

    def step_time(self, batch: BatchShape) -> float:
        """Seconds the step takes."""
        ...


def step_parts_of(cost_model: StepCostModel) -> Callable[[BatchShape], StepParts]:
    """``cost_model.step_parts``, or, for a model without the split, all of its time as model time."""
    parts = getattr(cost_model, "step_parts", None)
    if parts is not None:
        return parts
    step_time = cost_model.step_time

    def model_only(batch: BatchShape) -> StepParts:
        # Nothing known to be host work: async scheduling then gains nothing.
        t = step_time(batch)
        return t, 0.0, t

    return model_only


# A decode step's KV read rate as pieces linear in the summed context
# (ends, bases, slopes): on the first piece whose end the context does not
# pass (the last is unbounded) the rate is base + context * slope.
_KvPieces = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
# piece(num_decodes, context) -> (the piece's start, end, base, slope): see CostModel.kv_piece.
_KvPiece = Callable[[int, int], tuple[float, float, float, float]]

# run(ctx, now, until, num_steps, ends, totals, hosts, models) -> (steps, last start, last end, last ctx)
DecodeRunFn = Callable[[int, float, float, int, array, array, array, array], tuple[int, float, float, int]]


# Tails of at most this many ops are summed unrolled (see _unrolled_decode_run).
_UNROLLED = 16

# A decode-run clock with its sums written out term by term, in the order
# CostModel.decode_run's loop adds them; {mixer}, {tail_all} and {tail_model}
# become "+ m" and "+ a0 + a1 ..." for the cost model's own lengths, {kv}
# the KV read (see _kv_source).
_RUN_SOURCE = """
def make(d, head, hosts1, m, pair_flops, kv_bytes, qo, rate, kv_rate, fixed, piece, {names}):
    lo = hi = float("inf")
    kb = ks = 0.0
    def run(ctx, now, until, num_steps, ends, totals, hosts, models):
        end_at, total_at, model_at = ends.append, totals.append, models.append
{init}
        start = now
        n = 0
        # The loop's "while n < num_steps and now < until", counted by range.
        if now < until:
            for n in range(1, num_steps + 1):
                ctx += d
                tc = ctx * pair_flops / rate
{kv}
                base = head + (tc if tc > tm else tm){mixer}
                t = base{tail_all}
                start = now
                now = start + t
                end_at(now)
                total_at(t)
                model_at(base{tail_model})
                if now >= until:
                    break
        hosts.extend(hosts1 * n)
        return n, start, now, ctx
    return run
"""
_RUN_MAKERS: dict[tuple[int, int, bool, bool], Callable[..., DecodeRunFn]] = {}


def _kv_source(pieces: bool, indent: str) -> tuple[str, str]:
    """(the run's set-up before its loop, the step's KV time ``tm``) as generated source.

    Without ``pieces``: one KV rate at every context and no fixed time (the
    plain roofline), the formula as it always was. With them: the rate on
    ``CostModel.kv_piece``'s piece, kept between calls (most runs of a
    request count stay on one piece) and fetched again only when a run
    starts below it or its context passes its end (a run's context only
    grows), then ``fixed`` added.
    """
    tm = indent + "tm = ((ctx + d) * kv_bytes + qo) / {rate}"
    if not pieces:
        return "", tm.format(rate="kv_rate")
    init = "\n".join(
        [
            "        nonlocal lo, hi, kb, ks",
            "        if ctx + d <= lo:",
            "            lo, hi, kb, ks = piece(d, ctx + d)",
        ]
    )
    body = [
        f"{indent}if ctx > hi:",
        f"{indent}    lo, hi, kb, ks = piece(d, ctx)",
        tm.format(rate="(kb + ctx * ks)") + " + fixed",
    ]
    return init, "\n".join(body)


def _unrolled_decode_run(
    d: int,
    head: float,
    hosts1: array,
    tail_all: tuple[float, ...],
    tail_model: tuple[float, ...],
    mixer: float | None,
    pair_flops: float,
    kv_bytes: float,
    qo: float,
    rate: float,
    kv_rate: float,
    fixed: float,
    piece: _KvPiece | None,
) -> DecodeRunFn:
    """``CostModel.decode_run``'s clock with the tails summed in one expression instead of a loop.

    The same additions in the same order, so every figure is the same bit
    for bit; the loop over the tails cost more than the arithmetic. The
    clock's code is generated once per shape of tails.
    """
    key = (len(tail_all), len(tail_model), mixer is not None, piece is not None)
    make = _RUN_MAKERS.get(key)
    if make is None:
        names_all = [f"a{i}" for i in range(key[0])]
        names_model = [f"b{i}" for i in range(key[1])]
        init, kv = _kv_source(key[3], " " * 16)
        source = _RUN_SOURCE.format(
            names=", ".join(names_all + names_model) or "*_",
            mixer=" + m" if key[2] else "",
            tail_all="".join(f" + {x}" for x in names_all),
            tail_model="".join(f" + {x}" for x in names_model),
            init=init,
            kv=kv,
        )
        namespace: dict = {}
        exec(compile(source, f"<decode run {key}>", "exec"), namespace)
        make = _RUN_MAKERS[key] = namespace["make"]
    m = 0.0 if mixer is None else mixer
    return make(
        d, head, hosts1, m, pair_flops, kv_bytes, qo, rate, kv_rate, fixed, piece, *tail_all, *tail_model
    )


# run(ctx, now, device_free, until, num_steps, same, last_host, last_model, pending, ends, gaps,
#     host_s, model_s, gap_s, itl, count, sampled_at)
#   -> (calls, now, device_free, host_s, model_s, gap_s, last, before)
AsyncDecodeRunFn = Callable[..., tuple]

# An async decode-run clock: each call prices its step (decode_run's
# arithmetic, term by term), pipelines it as SimExecutor._pipeline does and
# applies the step before it (its end and host gap appended, its parts
# added to the running totals one by one, as StepCosts.add adds them, and
# ``count`` gaps from the step before it, ``sampled_at`` at first, added to
# the inter-token histogram ``itl`` as MetricsCollector.add_steps adds them). A
# step is (start, idle_from, end, host, model, host_gap); ``pending`` is the
# one in flight before the run, ``last`` and ``before`` the last two scheduled.
_ASYNC_RUN_SOURCE = """
def make(d, head, host, m, pair_flops, kv_bytes, qo, rate, kv_rate, fixed, piece, overlaps, price, {names}):
    lo = hi = float("inf")
    kb = ks = 0.0
    def run(ctx, now, free, until, num_steps, same, last_host, last_model, pending, ends, gaps,
            host_s, model_s, gap_s, itl, count, sampled_at):
        end_at, gap_at, itl_get = ends.append, gaps.append, itl.get
{init}
        last = before = pending
        _, _, p_end, p_host, p_model, p_gap = pending
        n = 0
        while n < num_steps and now < until:
            if n < same:
                ctx += d
{price}
            else:
                h = last_host
                model = last_model
            start = now
            if free > start and not overlaps:
                start = free
            host_end = start + h
            idle_from = free if free > start else start
            begin = host_end if host_end > free else free
            free = end = begin + model
            gap = host_end - idle_from if host_end > idle_from else 0.0
            end_at(p_end)
            gap_at(p_gap)
            g = p_end - sampled_at
            itl[g] = itl_get(g, 0) + count
            sampled_at = p_end
            host_s += p_host
            model_s += p_model
            gap_s += p_gap
            now = p_end if p_end > host_end else host_end
            before = last
            last = (start, idle_from, end, h, model, gap)
            p_end = end
            p_host = h
            p_model = model
            p_gap = gap
            n += 1
        return n, now, free, host_s, model_s, gap_s, last, before
    return run
"""
# A step's price, inlined from the cost model's terms, or asked of any cost model's ``price``.
_ASYNC_PRICE_INLINE = """\
                tc = ctx * pair_flops / rate
{kv}
                h = host
                model = head + (tc if tc > tm else tm){mixer}{tail_model}"""
_ASYNC_PRICE_CALL = "                _, h, model = price(ctx)"
_ASYNC_RUN_MAKERS: dict[tuple, Callable[..., AsyncDecodeRunFn]] = {}


def _unrolled_async_decode_run(
    d: int, terms: tuple, tail_model: tuple[float, ...], overlaps: bool
) -> AsyncDecodeRunFn:
    """``CostModel.async_decode_run``'s clock, generated once per tail length (see _unrolled_decode_run)."""
    head, host, _, _, mixer, pair_flops, kv_bytes, qo_bytes, rate, kv_rate, fixed, piece = terms
    names = [f"b{i}" for i in range(len(tail_model))]
    init, kv = _kv_source(piece is not None, " " * 16)
    priced = _ASYNC_PRICE_INLINE.format(
        mixer=" + m" if mixer is not None else "", tail_model="".join(f" + {x}" for x in names), kv=kv
    )
    make = _async_run_maker((len(tail_model), mixer is not None, piece is not None), names, priced, init)
    m = 0.0 if mixer is None else mixer
    qo = d * qo_bytes
    return make(
        d, head, host, m, pair_flops, kv_bytes, qo, rate, kv_rate, fixed, piece, overlaps, None, *tail_model
    )


def _async_run_maker(
    key: tuple, names: list[str], priced: str, init: str = ""
) -> Callable[..., AsyncDecodeRunFn]:
    """``_ASYNC_RUN_SOURCE``'s ``make`` with ``priced`` as its pricing lines, compiled once per key."""
    make = _ASYNC_RUN_MAKERS.get(key)
    if make is None:
        source = _ASYNC_RUN_SOURCE.format(names=", ".join(names) or "*_", price=priced, init=init)
        namespace: dict = {}
        exec(compile(source, f"<async decode run {key}>", "exec"), namespace)
        make = _ASYNC_RUN_MAKERS[key] = namespace["make"]
    return make


def async_decode_run_of(cost_model: StepCostModel, num_decodes: int, overlaps: bool) -> AsyncDecodeRunFn:
    """An async decode-run clock (see ``_ASYNC_RUN_SOURCE``) for any cost model.

    ``overlaps``: whether a host path may run beside the previous forward
    (``HardwareProfile.host_overlaps_model``). Cost models without their own
    (``async_decode_run``) step ``decode_step_parts_of``' prices.
    """
    fast = getattr(cost_model, "async_decode_run", None)
    if fast is not None:
        run = fast(num_decodes, overlaps)
        if run is not None:
            return run
    make = _async_run_maker(("any",), [], _ASYNC_PRICE_CALL)
    price = decode_step_parts_of(cost_model, num_decodes)
    return make(num_decodes, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, None, overlaps, price)


def decode_run_of(cost_model: StepCostModel, num_decodes: int) -> DecodeRunFn:
    """``StepCostModel.decode_run`` for any cost model (stepping ``decode_step_parts_of``' prices)."""
    fast = getattr(cost_model, "decode_run", None)
    if fast is not None:
        return fast(num_decodes)
    price = decode_step_parts_of(cost_model, num_decodes)
    d = num_decodes

    def run(
        ctx: int,
        now: float,
        until: float,
        num_steps: int,
        ends: array,
        totals: array,
        hosts: array,
        models: array,
    ) -> tuple[int, float, float, int]:
        start = now
        n = 0
        while n < num_steps and now < until:
            ctx += d
            total, host, model = price(ctx)
            start = now
            now = start + total
            ends.append(now)
            totals.append(total)
            hosts.append(host)
            models.append(model)
            n += 1
        return n, start, now, ctx

    return run


def decode_step_parts_of(cost_model: StepCostModel, num_decodes: int) -> Callable[[int], StepParts]:
    """The step parts of ``num_decodes`` one-token decodes by summed context, for any cost model."""
    fast = getattr(cost_model, "decode_step_parts", None)
    if fast is not None:
        return fast(num_decodes)
    parts = step_parts_of(cost_model)
    d = num_decodes
    return lambda decode_context: parts(BatchShape(d, d, 0, 0, 0, d, decode_context, 0))


class ConstantCostModel:
    """Every step takes the same time: a step-clocked simulation (tests, what-ifs).

    ``seconds`` is the model (device) time of every step and ``host_seconds``
    its host path: a sync step takes their sum, an async one overlaps them.
    """

    def __init__(self, seconds: float = 1.0, host_seconds: float = 0.0) -> None:
        if seconds < 0 or host_seconds < 0:
            raise ConfigError(f"seconds={seconds} and host_seconds={host_seconds} must be >= 0")
        self.seconds = seconds
        self.host_seconds = host_seconds

    def step_time(self, batch: BatchShape) -> float:
        """The constant (host path plus model time)."""
        return self.seconds + self.host_seconds

    def step_parts(self, batch: BatchShape) -> StepParts:
        """(sync step time, host path, model time)."""
        return self.seconds + self.host_seconds, self.host_seconds, self.seconds

    def __repr__(self) -> str:
        return f"ConstantCostModel(seconds={self.seconds!r}, host_seconds={self.host_seconds!r})"


class CostModel:
    """Roofline time of one step of ``model`` on ``hardware`` under ``parallel``."""

    def __init__(
        self,
        model: ModelShape,
        hardware: HardwareProfile,
        parallel: Parallelism | None = None,
        efficiency: Efficiency | None = None,
        step_overhead_s: float | None = None,
        kv_cache_dtype_bytes: float | None = None,
        cuda_graph_max_tokens: int = 512,
        launch_latency_s: float | None = None,
        kernels_per_layer: float | None = None,
        lora_rank: int = 0,
    ) -> None:
        self.model = model
        # The rank every adapter is priced at (vLLM pads to max_lora_rank); 0: LoRA is not priced.
        if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
            raise ConfigError(f"lora_rank={lora_rank!r} must be an integer >= 0")
        self.lora_rank = lora_rank
        self.hardware = hardware
        self.parallel = parallel or Parallelism()
        self.efficiency = efficiency or Efficiency(**(hardware.efficiency or {}))
        if step_overhead_s is None:
            step_overhead_s = 5e-4 if hardware.step_overhead_s is None else hardware.step_overhead_s
        if step_overhead_s < 0:
            raise ConfigError(f"step_overhead_s={step_overhead_s} must be >= 0")
        self.step_overhead_s = step_overhead_s
        # cuda_graph_max_tokens: the largest captured step (0: no graphs);
        # launch_latency_s: one eager kernel launch (None: the hardware's);
        # kernels_per_layer: eager launches per layer (None: counted above).
        if isinstance(cuda_graph_max_tokens, bool) or not isinstance(cuda_graph_max_tokens, int):
            raise ConfigError(f"cuda_graph_max_tokens={cuda_graph_max_tokens!r} must be an integer >= 0")
        if cuda_graph_max_tokens < 0:
            raise ConfigError(f"cuda_graph_max_tokens={cuda_graph_max_tokens} must be >= 0")
        self.cuda_graph_max_tokens = cuda_graph_max_tokens
        if launch_latency_s is None:
            launch_latency_s = hardware.kernel_launch_s
        if launch_latency_s < 0:
            raise ConfigError(f"launch_latency_s={launch_latency_s} must be >= 0")
        self.launch_latency_s = launch_latency_s
        if kernels_per_layer is not None and kernels_per_layer < 0:
            raise ConfigError(f"kernels_per_layer={kernels_per_layer} must be >= 0")
        self.kernels_per_layer_override = kernels_per_layer
        m, hw, eff = model, hardware, self.efficiency
        tp = self.tp = self.parallel.tensor_parallel_size
        ep_on = self.parallel.enable_expert_parallel and m.is_moe
        self.ep = tp * self.parallel.data_parallel_size if ep_on else 1
        self.act_bytes = m.dtype_bytes
        self.kv_bytes = kv_cache_dtype_bytes if kv_cache_dtype_bytes else m.dtype_bytes
        self.gemm_rate = hw.gemm_peak(m.fp8_weights) * eff.gemm
        self.attn_rate = hw.peak_flops_bf16 * eff.attention
        # Size-dependent efficiencies (hardware.efficiency_curves): (log2
        # sizes, rates) replacing the constant rates above; None: those.
        curves = hw.efficiency_curves or {}
        self._gemm_curve = _rate_curve(curves.get("gemm"), hw.gemm_peak(m.fp8_weights))
        self._attn_curve = _rate_curve(curves.get("attention"), hw.peak_flops_bf16)
        self.mem_rate = hw.mem_bandwidth * eff.memory
        self.kv_read_rate = hw.decode_kv_bandwidth or self.mem_rate
        # Measured-kernel fit (kernel_fit.py): per-GEMM efficiency curves,
        # elementwise and attention floors; None prices the plain roofline.
        self.kfit = KernelFit.from_dict(hw.kernel_fit) if hw.kernel_fit else None
        # With a fit the KV rate depends on the decode count and context: pieces kept per count.
        self._kv_pieces: dict[int, _KvPieces] = {}
        # _decode_seconds' clock per decode count.
        self._decode_clocks: dict[int, Callable[[int], float]] = {}
        self.layer_overhead_s = model.num_layers * hw.layer_overhead_s
        self.layer_overhead_covers_tokens = hw.layer_overhead_covers_tokens
        self.host_overlaps_model = hw.host_overlaps_model
        self.request_overhead_s = hw.request_overhead_s
        self.link_rate = hw.link_bandwidth * eff.network
        self.latency = hw.collective_latency_s
        # step_parts' figures per batch shape (see there).
        self._shape_ops: dict[tuple[int, int, int, int], _ShapeOps] = {}
        self._precompute()

    def _precompute(self) -> None:
        m, tp, a = self.model, self.tp, self.act_bytes
        # Attention layers (a hybrid model's Mamba layers have none; see _precompute_mamba).
        L = m.num_attention_layers
        # Attention projections on one GPU: weights and activation widths.
        attn_w = 0.0
        attn_io = 0.0
        for name, fin, fout, sharded in m.attention_linears():
            if name == "qkv_proj":
                kvh = m.kv_heads_per_gpu(tp)
                out = m.q_dim / tp + 2 * kvh * m.head_dim
                attn_w += fin * out
                attn_io += fin + out
            elif sharded:
                attn_w += fin * fout / tp
                attn_io += (fin + fout) / tp
            else:
                attn_w += fin * fout
                attn_io += fin + fout
        self.attn_linear_params = L * attn_w
        # Per layer (K, N) of each attention GEMM on one GPU, for the kernel fit.
        self.attn_gemm_dims = [
            (fin, m.q_dim / tp + 2 * m.kv_heads_per_gpu(tp) * m.head_dim)
            if name == "qkv_proj"
            else (fin, fout / tp if sharded else fout)
            for name, fin, fout, sharded in m.attention_linears()
        ]
        self.attn_linear_io = L * attn_io * a
        # Dense MLP layers.
        ld = m.num_mlp_dense_layers
        self.mlp_params = ld * m.dense_mlp_params() / tp
        self.mlp_io = ld * (2 * m.hidden_size + 3 * m.intermediate_size / tp) * a
        # Attention core: FLOPs per (query, key) pair and KV bytes per token, all layers.
        self.query_heads = m.num_heads / tp
        if m.is_mla:
            heads = m.num_heads / tp
            self.prefill_pair_flops = L * 2 * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
            self.decode_pair_flops = L * 2 * heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
            # A prefill chunk up-projects its cached context's latents to keys and values.
            self.context_upproj_flops = L * 2 * m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        else:
            per_pair = 4 * (m.num_heads / tp) * m.head_dim
            self.prefill_pair_flops = self.decode_pair_flops = L * per_pair
            self.context_upproj_flops = 0.0
        self.kv_token_bytes = L * m.kv_elements_per_token_layer(tp) * self.kv_bytes
        self.qo_token_bytes = L * 2 * (m.q_dim / tp) * a
        # The fit's decode-kernel floor and per-request cost, all layers.
        self.decode_floor_s = L * self.kfit.decode_floor_s if self.kfit else 0.0
        self.decode_request_s = L * self.kfit.decode_request_s if self.kfit else 0.0
        # Elementwise work per token.
        if m.is_moe:
            k = m.num_experts_per_tok
            moe_width = (k * m.moe_intermediate_size + m.shared_expert_intermediate_size) / tp
        else:
            moe_width = 0.0
        if m.is_mla:
            rope_width = m.num_heads / tp * m.qk_rope_head_dim + m.qk_rope_head_dim
        else:
            rope_width = m.q_dim / tp + m.kv_heads_per_gpu(tp) * m.head_dim
        self.rope_width, self.moe_act_width = rope_width, moe_width
        self.elementwise_token_bytes = a * (
            m.num_layers * _ELEMENTWISE_HIDDEN_PASSES * m.hidden_size
            + L * _ROPE_PASSES * rope_width
            + _ACTIVATION_PASSES * (ld * m.intermediate_size / tp + m.num_moe_layers * moe_width)
        )
        # Embedding (vocab-parallel lookup) and LM head (vocab-parallel).
        self.lm_head_params = m.vocab_size * m.hidden_size / tp
        self.vocab_per_gpu = m.vocab_size / tp
        self._precompute_mamba()
        self._precompute_launches()

    def _precompute_mamba(self) -> None:
        """A hybrid model's Mamba2 mixers: projections, and the conv and SSD scan per token and state."""
        m, tp, a = self.model, self.tp, self.act_bytes
        Lm = m.num_mamba_layers
        self.mamba_linear_params = self.mamba_linear_io = 0.0
        self.mamba_prefill_flops = self.mamba_decode_flops = self.mamba_state_bytes = 0.0
        self.mamba_token_bytes = 0.0
        if not Lm:
            return
        h, di, conv = m.hidden_size, m.mamba_d_inner / tp, m.mamba_conv_dim / tp
        heads, P, N, Q = m.mamba_n_heads / tp, m.mamba_head_dim, m.mamba_d_state, m.mamba_chunk_size
        in_w = di + conv + heads
        self.mamba_linear_params = Lm * (h * in_w + di * h)
        self.mamba_linear_io = Lm * (h + in_w + di + h) * a
        conv_flops = 2 * m.mamba_d_conv * conv
        # A decode updates each head's P x N state (decay, add dt * B x) and reads it out with C.
        self.mamba_decode_flops = Lm * (conv_flops + 6 * heads * P * N)
        # SSD over chunks of Q tokens: the intra-chunk C.B^T and its product with x (quadratic in Q),
        # then the chunk states and their contribution to the outputs.
        groups = m.mamba_n_groups / tp if m.mamba_n_groups >= tp else 1
        self.mamba_prefill_flops = Lm * (conv_flops + 2 * Q * (groups * N + heads * P) + 4 * heads * P * N)
        # Every token's x, B, C, dt read and y written by the conv and scan kernels.
        self.mamba_token_bytes = Lm * 2 * (conv + di) * a
        # A request's state (conv window and SSM state, all Mamba layers) read and written once per step.
        self.mamba_state_bytes = 2 * Lm * m.mamba_state_elements_per_layer(tp) * m.dtype_bytes

    def _precompute_launches(self) -> None:
        m, tp, ep = self.model, self.tp, self.ep
        lin = 2 if m.fp8_weights else 1
        ar = 1 if tp > 1 else 0
        if m.is_mla:
            core = 1 + _MLA_CORE_FIXED_KERNELS + lin
            latent_norms = 2 if m.q_lora_rank else 1
            attn = 1 + 3 * lin + latent_norms + 1 + ar + core
        else:
            core = _GQA_CORE_KERNELS
            attn = 1 + 2 * lin + 1 + ar + core
        dense = 1 + 2 * lin + 1 + ar
        moe = 0
        if m.is_moe:
            shared = 2 * lin + 1 if m.shared_expert_intermediate_size else 0
            exchange = _EP_EXCHANGE_KERNELS if ep > 1 else ar
            moe = 1 + 1 + _TOPK_KERNELS + shared + _ROUTED_EXPERT_KERNELS + exchange + 1
        L = m.num_layers
        La, Lm = m.num_attention_layers, m.num_mamba_layers
        # A Mamba2 mixer: RMSNorm, in_proj, the conv, the SSD scan (its core,
        # kept out of piecewise graphs like attention's), gated norm, out_proj.
        mamba = 1 + 2 * lin + _MAMBA_CORE_KERNELS + 1 + ar
        if self.kernels_per_layer_override is not None:
            eager = L * self.kernels_per_layer_override
        else:
            eager = La * attn + Lm * mamba + m.num_mlp_dense_layers * dense + m.num_moe_layers * moe
        self.eager_launches = eager
        # Piecewise: each layer replays its graph pieces (one launch) and runs
        # the attention core (or the Mamba mixer's) eagerly.
        self.piecewise_launches = La * (core + 1) + Lm * (_MAMBA_CORE_KERNELS + 1)
        self.eager_launch_s = eager * self.launch_latency_s
        self.piecewise_launch_s = self.piecewise_launches * self.launch_latency_s

    def launch_mode(self, batch: BatchShape) -> int:
        """LAUNCH_GRAPH, LAUNCH_PIECEWISE or LAUNCH_EAGER: how vLLM would launch this batch."""
        if batch.num_tokens > self.cuda_graph_max_tokens:
            return LAUNCH_EAGER
        return LAUNCH_GRAPH if batch.prefill_tokens == batch.spec_tokens else LAUNCH_PIECEWISE

    # ---- the ops of one step ---------------------------------------------------

    def _ops(
        self, b: BatchShape, group_tokens: int | None = None, mode: int | None = None
    ) -> list[tuple[str, float, float, float, float, str]]:
        """(name, flops, bytes, comm_bytes, seconds, bound) per op; one code path for all callers.

        ``group_tokens``: tokens the whole expert-parallel group runs this
        step (every data-parallel rank's); None means only this batch's.
        ``mode``: the launch mode the group agreed on; None means this
        batch's own.
        """
        m = self.model
        T = b.num_tokens
        S = b.num_sampled
        wb, a = m.weight_bytes, self.act_bytes
        gemm, attn, mem = self.gemm_rate, self.attn_rate, self.mem_rate
        head_rate, gemm_mem = gemm, mem
        if self._gemm_curve is not None:
            # The curve was timed on weights larger than the caches, so it
            # holds their streaming too: no separate memory bound.
            gemm, head_rate = _rate_at(self._gemm_curve, T), _rate_at(self._gemm_curve, S)
            gemm_mem = math.inf
        ops: list[tuple[str, float, float, float, float, str]] = []

        def roof(name: str, flops: float, nbytes: float, rate: float, mem: float = mem) -> None:
            # _roof_seconds' arithmetic, spelled out for the bound's name.
            tc, tm = flops / rate, nbytes / mem
            ops.append((name, flops, nbytes, 0.0, tc if tc > tm else tm, "compute" if tc > tm else "memory"))

        def comm(name: str, n: int, nbytes: float) -> None:
            ops.append((name, 0.0, 0.0, nbytes, n * self.latency + nbytes / self.link_rate, "network"))

        if T == 0:
            return ops
        h = m.hidden_size
        kf = self.kfit

        def fitted(name: str, flops: float, nbytes: float, seconds: float, rate: float) -> None:
            # The fit's price; the bound named as the plain roofline would.
            ops.append(
                (name, flops, nbytes, 0.0, seconds, "compute" if flops / rate > nbytes / mem else "memory")
            )

        if kf is None:
            roof("embedding", 0.0, 2 * T * h * a, mem)
        else:
            nb = 2 * T * h * a
            s = kf.elementwise_seconds("emb", nb, T, self.hardware.mem_bandwidth)
            fitted("embedding", 0.0, nb, s, mem)
        p = self.attn_linear_params
        if kf is None:
            roof("attention_linears", 2 * T * p, p * wb + T * self.attn_linear_io, gemm, gemm_mem)
        else:
            s = m.num_attention_layers * self._fitted_gemms(T, self.attn_gemm_dims, wb)
            fitted("attention_linears", 2 * T * p, p * wb + T * self.attn_linear_io, s, gemm)
        if b.prefill_tokens:
            flops, nbytes = self._prefill_attention(b)
            fitted("attention_prefill", flops, nbytes, self._prefill_seconds(b, flops, nbytes), attn)
        if b.num_decodes:
            flops, nbytes = self._decode_attention(b)
            s = self._decode_seconds(b.num_decodes, b.decode_context)
            ops.append(
                ("attention_decode", flops, nbytes, 0.0, s, "compute" if s == flops / attn else "memory")
            )
        if self.mamba_linear_params:
            roof("mamba_mixer", *self._mamba_mixer(b), attn)
            p = self.mamba_linear_params
            roof("mamba_linears", 2 * T * p, p * wb + T * self.mamba_linear_io, gemm, gemm_mem)
        if self.mlp_params:
            p = self.mlp_params
            if kf is None:
                roof("mlp", 2 * T * p, p * wb + T * self.mlp_io, gemm, gemm_mem)
            else:
                inter = m.intermediate_size / self.tp
                dims = [(h, 2 * inter), (inter, h)]
                s = m.num_mlp_dense_layers * self._fitted_gemms(T, dims, wb)
                fitted("mlp", 2 * T * p, p * wb + T * self.mlp_io, s, gemm)
        if m.is_moe:
            self._moe_ops(T, T if group_tokens is None else group_tokens, roof, comm)
        ew_flops, ew_bytes = 2 * T * self.elementwise_token_bytes / a, T * self.elementwise_token_bytes
        if kf is None:
            roof("norms_activations", ew_flops, ew_bytes, mem)
        else:
            fitted("norms_activations", ew_flops, ew_bytes, self._fitted_elementwise(T), mem)
        if S:
            p = self.lm_head_params
            nb = p * m.dtype_bytes + S * self.vocab_per_gpu * _LOGIT_BYTES
            if kf is None:
                roof("lm_head", 2 * S * p, nb, head_rate, gemm_mem)
            else:
                s = self._fitted_gemms(S, [(h, self.vocab_per_gpu)], m.dtype_bytes)
                fitted("lm_head", 2 * S * p, nb, s, gemm)
            roof(
                "sampler",
                10.0 * S * m.vocab_size,
                _SAMPLER_PASSES * S * m.vocab_size * _LOGIT_BYTES,
                mem,
            )
        tp = self.tp
        if tp > 1:
            ring = 2 * (tp - 1) / tp
            # Two all-reduces per layer (attention out, MLP out) plus the
            # vocab-parallel embedding; MoE layers under EP exchange tokens
            # with all-to-alls instead of the MLP all-reduce.
            n = 2 * m.num_layers + 1 - (m.num_moe_layers if self.ep > 1 else 0)
            comm("tp_all_reduce", n, n * ring * T * h * a)
            if S:
                comm("logits_all_gather", 1, (tp - 1) / tp * S * m.vocab_size * _LOGIT_BYTES)
        if self.step_overhead_s:
            ops.append(("step_overhead", 0.0, 0.0, 0.0, self.step_overhead_s, "overhead"))
        if self.layer_overhead_s:
            ops.append(("layer_overhead", 0.0, 0.0, 0.0, self._layer_overhead(T, ops), "overhead"))
        if self.request_overhead_s:
            n = b.num_decodes + b.num_prefills
            ops.append(("request_overhead", 0.0, 0.0, 0.0, n * self.request_overhead_s, "overhead"))
        if mode is None:
            mode = self.launch_mode(b)
        # Charged in full, as if no launch overlapped a running kernel: exact
        # when kernels are shorter than their launches (decode-sized work),
        # an upper bound for the long kernels of a large prefill.
        if mode == LAUNCH_EAGER and self.eager_launch_s:
            ops.append(("eager_launches", 0.0, 0.0, 0.0, self.eager_launch_s, "overhead"))
        elif mode == LAUNCH_PIECEWISE and self.piecewise_launch_s:
            ops.append(("piecewise_launches", 0.0, 0.0, 0.0, self.piecewise_launch_s, "overhead"))
        if b.lora_tokens and self.lora_rank:
            roof("lora", *self._lora_products(b), gemm)
        return ops

    def _fitted_gemms(self, tokens: int, dims: list[tuple[float, float]], wbytes: float) -> float:
        """One layer's GEMMs of ``dims`` (K, N) at ``tokens`` rows, priced by the kernel fit."""
        hw, kf = self.hardware, self.kfit
        peak = hw.gemm_peak(self.model.fp8_weights)
        return sum(
            kf.gemm_seconds(tokens, k, n, peak, hw.mem_bandwidth, wbytes, self.act_bytes) for k, n in dims
        )

    def _fitted_elementwise(self, tokens: int) -> float:
        """The step's norms, rotary embeddings and activations, kernel by kernel with the fit's floors."""
        m, kf, a, bw = self.model, self.kfit, self.act_bytes, self.hardware.mem_bandwidth
        # vLLM's fused residual-add + RMSNorm reads input and residual and writes both.
        t = 2 * m.num_layers * kf.elementwise_seconds("norm", 4 * tokens * m.hidden_size * a, tokens, bw)
        t += m.num_attention_layers * kf.elementwise_seconds(
            "rope", _ROPE_PASSES * tokens * self.rope_width * a, tokens, bw
        )
        if m.num_mlp_dense_layers:
            nb = _ACTIVATION_PASSES * tokens * m.intermediate_size / self.tp * a
            t += m.num_mlp_dense_layers * kf.elementwise_seconds("act", nb, tokens, bw)
        if m.num_moe_layers:
            nb = _ACTIVATION_PASSES * tokens * self.moe_act_width * a
            t += m.num_moe_layers * kf.elementwise_seconds("act", nb, tokens, bw)
        return t

    def _prefill_seconds(self, b: BatchShape, flops: float, nbytes: float) -> float:
        """The prefill attention core's time: per layer by the kernel fit, or on the roofline."""
        if self.kfit is None:
            rate = self.attn_rate
            if self._attn_curve is not None:
                # The prefill kernel's efficiency follows the keys each query reads.
                rate = _rate_at(self._attn_curve, b.prefill_pairs / b.prefill_tokens)
            return _roof_seconds(flops, nbytes, rate, self.mem_rate)
        hw, L = self.hardware, self.model.num_attention_layers
        causal = b.prefill_causal * self.prefill_pair_flops
        return L * self.kfit.prefill_attention_seconds(
            (flops - causal) / L,
            causal / L,
            b.prefill_tokens * self.query_heads,
            nbytes / L,
            hw.peak_flops_bf16,
            hw.mem_bandwidth,
        )

    def kv_pieces(self, num_decodes: int) -> _KvPieces | None:
        """The KV rate of ``num_decodes`` decodes by their summed context (``_KvPieces``); None: constant.

        The fit's rate is linear in the mean context per request between its
        context knots, so for a fixed request count it is linear in the
        summed context, with the knots scaled by the count.
        """
        if self.kfit is None:
            return None
        pieces = self._kv_pieces.get(num_decodes)
        if pieces is None:
            d = num_decodes
            knots = self.kfit.decode_ctx_knots
            rates = self.kfit.decode_kv_rates(self.hardware.mem_bandwidth, d)
            bases, slopes = [rates[0]], [0.0]
            for j in range(1, len(knots)):
                slope = (rates[j] - rates[j - 1]) / ((knots[j] - knots[j - 1]) * d)
                bases.append(rates[j - 1] - knots[j - 1] * d * slope)
                slopes.append(slope)
            bases.append(rates[-1])
            slopes.append(0.0)
            pieces = (tuple(k * d for k in knots), tuple(bases), tuple(slopes))
            self._kv_pieces[d] = pieces
        return pieces

    def kv_piece(self, num_decodes: int, decode_context: int) -> tuple[float, float, float, float]:
        """The piece of ``kv_pieces`` that ``decode_context`` lies on: (start, end, base, slope); needs a fit.

        A context on it is above its start and at most its end.
        """
        pieces = self.kv_pieces(num_decodes)
        assert pieces is not None, "a constant KV rate has no pieces"
        ends, bases, slopes = pieces
        start = -math.inf
        for i, end in enumerate(ends):
            if decode_context <= end:
                return start, end, bases[i], slopes[i]
            start = end
        return start, math.inf, bases[-1], slopes[-1]

    def kv_rate(self, num_decodes: int, decode_context: int) -> float:
        """Bytes/s at which ``num_decodes`` decodes of ``decode_context`` summed context read their KV."""
        if self.kfit is None:
            return self.kv_read_rate
        _, _, base, slope = self.kv_piece(num_decodes, decode_context)
        return base + decode_context * slope

    def _decode_seconds(self, num_decodes: int, decode_context: int) -> float:
        """The decode attention cores' time (``_decode_seconds_of``'s clock for the count, kept per count)."""
        seconds = self._decode_clocks.get(num_decodes)
        if seconds is None:
            seconds = self._decode_clocks[num_decodes] = self._decode_seconds_of(num_decodes)
        return seconds(decode_context)

    def _decode_seconds_of(self, num_decodes: int) -> Callable[[int], float]:
        """The decode attention cores' time of ``num_decodes`` decodes, as a function of their summed context.

        The roofline of their FLOPs and KV read, plus the fit's floors; the
        KV piece is kept between calls. The generated decode-run clocks
        repeat this arithmetic term for term, so their figures match bit for
        bit.
        """
        d, pair_flops, rate = num_decodes, self.decode_pair_flops, self.attn_rate
        kv_bytes, qo = self.kv_token_bytes, num_decodes * self.qo_token_bytes
        if self.kfit is None:
            kv_rate = self.kv_read_rate

            def seconds(ctx: int) -> float:
                tc = ctx * pair_flops / rate
                tm = ((ctx + d) * kv_bytes + qo) / kv_rate
                return tc if tc > tm else tm

            return seconds
        fixed, piece = self._decode_fixed_s(d), self.kv_piece
        lo = hi = math.inf
        kb = ks = 0.0

        def seconds_on_pieces(ctx: int) -> float:
            nonlocal lo, hi, kb, ks
            if not lo < ctx <= hi:
                lo, hi, kb, ks = piece(d, ctx)
            tc = ctx * pair_flops / rate
            tm = ((ctx + d) * kv_bytes + qo) / (kb + ctx * ks) + fixed
            return tc if tc > tm else tm

        return seconds_on_pieces

    def _decode_fixed_s(self, num_decodes: int) -> float:
        """The fit's decode-kernel floors and per-request costs, all layers (0 without a fit)."""
        return self.decode_floor_s + num_decodes * self.decode_request_s

    def _layer_overhead(self, num_tokens: int, ops: list[_OpRow]) -> float:
        """The layers' host time left on the critical path once the weight GEMMs have run inside it.

        Measured on the development machine (2 cores, two OpenMP threads):
        eight decoder layers with 80 MB of weights (hidden 512, a
        32k-vocabulary LM head) ran steps of 1, 8 and 32 decodes and a
        32-token prefill in the time eight layers of the calibration's
        narrow probe took (6.2, 8.2, 7.6 and 9.1 ms; the GEMMs alone price
        at 2.5-4 ms), while a 128-token prefill took the probe's time plus
        its GEMMs' (26.9 = 12.3 + 15.4 ms). So for steps of at most
        ``HardwareProfile.layer_overhead_covers_tokens`` tokens (the probe's
        largest batch, where the per-layer cost was fitted) only what the
        GEMMs leave of the layers' host time is charged; larger steps, and
        every GPU profile, pay it in full.
        """
        t = self.layer_overhead_s
        if num_tokens > self.layer_overhead_covers_tokens:
            return t
        for name, _, _, _, seconds, _ in ops:
            if name in _WEIGHT_GEMMS:
                t -= seconds
        return t if t > 0.0 else 0.0

    def _lora_products(self, b: BatchShape) -> tuple[float, float]:
        """(FLOPs, bytes) of the shrink and expand products on q/k/v/o/gate/up/down for the adapter tokens.

        Each adapter's A and B are read once per step; every adapter token
        runs ``2 * rank * (in + out)`` FLOPs per targeted matmul and writes
        its rank-wide intermediate.
        """
        m, tp, r = self.model, self.tp, self.lora_rank
        h, q, kv, inter = (
            m.hidden_size,
            m.q_dim / tp,
            m.num_kv_heads * m.head_dim / tp,
            m.intermediate_size / tp,
        )
        # in + out features of q, k, v, o, gate, up and down on one GPU, over all layers.
        widths = m.num_layers * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h))
        flops = 2.0 * b.lora_tokens * r * widths
        act = 2.0 * b.lora_tokens * r * 7 * m.num_layers * self.act_bytes
        nbytes = b.num_loras * r * widths * m.dtype_bytes + act
        return flops, nbytes

    def _prefill_attention(self, b: BatchShape) -> tuple[float, float]:
        """(FLOPs, bytes) of the step's prefill attention core."""
        return (
            b.prefill_pairs * self.prefill_pair_flops + b.prefill_context * self.context_upproj_flops,
            (b.prefill_context + 2 * b.prefill_tokens) * self.kv_token_bytes
            + b.prefill_tokens * self.qo_token_bytes,
        )

    def _mamba_mixer(self, b: BatchShape) -> tuple[float, float]:
        """(FLOPs, bytes) of the step's Mamba2 convolutions and scans: per token, plus per state."""
        decodes = b.num_decodes
        prefill = b.num_tokens - decodes
        flops = prefill * self.mamba_prefill_flops + decodes * self.mamba_decode_flops
        nbytes = b.num_tokens * self.mamba_token_bytes + (decodes + b.num_prefills) * self.mamba_state_bytes
        return flops, nbytes

    def _decode_attention(self, b: BatchShape) -> tuple[float, float]:
        """(FLOPs, bytes) of the step's decode attention core."""
        return (
            b.decode_context * self.decode_pair_flops,
            (b.decode_context + b.num_decodes) * self.kv_token_bytes + b.num_decodes * self.qo_token_bytes,
        )

    def _moe_ops(self, T: int, G: int, roof: _Roof, comm: _Comm) -> None:
        # T: this engine's tokens (router, shared experts); G: the expert-
        # parallel group's tokens, which decide the routed experts' work.
        m, tp, ep = self.model, self.tp, self.ep
        L = m.num_moe_layers
        h, a, wb = m.hidden_size, self.act_bytes, m.weight_bytes
        k = m.num_experts_per_tok
        E = m.num_experts
        roof(
            "moe_router",
            2 * T * h * E * L,
            L * (h * E * m.dtype_bytes + T * (h * a + E * 4)),
            self.gemm_rate,
        )
        # Experts read from memory this step: every expert a token is routed
        # to, bounded by how many there are (an upper bound: skewed routing
        # touches fewer).
        assignments = (G if ep > 1 else T) * k
        if ep > 1:
            local = E // ep
            touched = min(local, assignments)
            w = touched * m.expert_params()
            flops = 2 * (assignments / ep) * m.expert_params()
            io = (assignments / ep) * (2 * h + 3 * m.moe_intermediate_size) * a
        else:
            touched = min(E, assignments)
            w = touched * m.expert_params() / tp
            flops = 2 * assignments * m.expert_params() / tp
            io = assignments * (2 * h + 3 * m.moe_intermediate_size / tp) * a
        roof("moe_experts", L * flops, L * (w * wb + io), self.gemm_rate)
        if m.shared_expert_intermediate_size:
            p = m.shared_expert_params() / tp
            roof(
                "moe_shared_experts",
                L * 2 * T * p,
                L * (p * wb + T * (2 * h + 3 * m.shared_expert_intermediate_size / tp) * a),
                self.gemm_rate,
            )
        if ep > 1:
            # Dispatch and combine: each GPU sends its share of the tokens'
            # top-k copies to the experts' owners and gets them back, then
            # the hidden states are all-gathered across the TP group. The
            # exchange waits for the busiest GPU: the biggest sender, or the
            # receivers when the group's tokens spread evenly.
            per_gpu = max(T / tp, G / ep)
            a2a = per_gpu * k * h * a * (ep - 1) / ep
            gather = T * h * a * (tp - 1) / tp if tp > 1 else 0.0
            # Every exchange pays the same fixed latency whether it runs
            # DeepEP's low-latency (decode) or normal (prefill) kernels:
            # DeepEP's V1 tables (docs/legacy.md) give the low-latency
            # kernels' total time at one batch size only (128 tokens: 118 us
            # dispatch at EP16, which is just its bytes over the quoted 63
            # GB/s) and only bandwidths for the normal ones, so no fixed
            # per-mode latency can be separated from them. The normal
            # kernels' CPU wait for the receive counts is documented there
            # but not measured either.
            comm("ep_all_to_all", 3 * L, L * (2 * a2a + gather))

    # ---- public ----------------------------------------------------------------

    def ops(
        self, batch: BatchShape, group_tokens: int | None = None, mode: int | None = None
    ) -> list[OpCost]:
        """The step's operations with their FLOPs, bytes, seconds and what bounds them."""
        return [OpCost(*op) for op in self._ops(batch, group_tokens, mode)]

    def step_time(self, batch: BatchShape) -> float:
        """Seconds one step takes on the virtual clock (0 for an empty batch)."""
        if batch.num_tokens == 0:
            return 0.0
        t = 0.0
        for op in self._ops(batch):
            t += op[4]
        return t

    def step_parts(self, batch: BatchShape) -> StepParts:
        """(sync step time, host path, model time) in seconds; the first is exactly ``step_time``.

        Only the attention cores depend on the batch's context; every other
        op's time is a function of the token, sample and request counts and
        the launch mode, so those are kept per such shape and the sums are
        taken in ``_ops``' order (bit for bit the same figures, several
        times faster: a simulation prices every step).
        """
        if batch.num_tokens == 0:
            return _NO_PARTS
        mode = self.launch_mode(batch)
        key = (batch.num_tokens, batch.num_sampled, batch.num_decodes + batch.num_prefills, mode)
        ops = self._shape_ops.get(key)
        if ops is None:
            ops = self._shape_ops[key] = self._split_ops(batch, mode)
        t = host = model = 0.0
        # Summed in the same order as step_time, so sync prices stay bit for bit.
        for s in ops[0]:
            t += s
            model += s
        if batch.prefill_tokens:
            flops, nbytes = self._prefill_attention(batch)
            s = self._prefill_seconds(batch, flops, nbytes)
            t += s
            model += s
        if batch.num_decodes:
            s = self._decode_seconds(batch.num_decodes, batch.decode_context)
            t += s
            model += s
        if self.mamba_linear_params:
            flops, nbytes = self._mamba_mixer(batch)
            s = _roof_seconds(flops, nbytes, self.attn_rate, self.mem_rate)
            t += s
            model += s
        for s, on_host in ops[1]:
            t += s
            if on_host:
                host += s
            else:
                model += s
        if batch.lora_tokens and self.lora_rank:
            flops, nbytes = self._lora_products(batch)
            s = _roof_seconds(flops, nbytes, self.gemm_rate, self.mem_rate)
            t += s
            model += s
        return t, host, model

    def decode_step_parts(self, num_decodes: int) -> Callable[[int], StepParts]:
        """``step_parts`` of ``num_decodes`` one-token decodes, as a function of their summed context.

        For stretches of steps that differ only in context (the simulator's
        plain decode steps): the same figures, bit for bit, for a fraction
        of the work.
        """
        d = num_decodes
        head, host, tail_all, tail_model, mixer, *_ = self._decode_terms(d)
        attention = self._decode_seconds_of(d)

        def parts(decode_context: int) -> StepParts:
            t = model = head + attention(decode_context)
            if mixer is not None:
                t = model = t + mixer
            for s in tail_all:
                t += s
            for s in tail_model:
                model += s
            return t, host, model

        return parts

    def decode_run(self, num_decodes: int) -> DecodeRunFn:
        """A clock for runs of ``num_decodes`` one-token decodes: ``decode_step_parts``' figures, stepped.

        ``run(ctx, now, until, num_steps, ends, totals, hosts, models)``
        prices up to ``num_steps`` steps, each starting before ``until``
        (``ctx``: the summed context before the first; each step adds
        ``num_decodes``), appends each one's end and parts, and returns
        ``(steps, last start, last end, last context)``. The arithmetic of
        ``decode_step_parts`` inline, without a call per step.
        """
        d = num_decodes
        head, host, tail_all, tail_model, mixer, pair_flops, kv_bytes, qo_bytes, *kv = self._decode_terms(d)
        hosts1 = array("d", (host,))
        if len(tail_all) <= _UNROLLED and len(tail_model) <= _UNROLLED:
            return _unrolled_decode_run(
                d, head, hosts1, tail_all, tail_model, mixer, pair_flops, kv_bytes, d * qo_bytes, *kv
            )
        attention = self._decode_seconds_of(d)

        def run(
            ctx: int,
            now: float,
            until: float,
            num_steps: int,
            ends: array,
            totals: array,
            hosts: array,
            models: array,
        ) -> tuple[int, float, float, int]:
            end_at, total_at, model_at = ends.append, totals.append, models.append
            start = now
            n = 0
            while n < num_steps and now < until:
                ctx += d
                # parts(ctx) of decode_step_parts, term for term.
                t = model = head + attention(ctx)
                if mixer is not None:
                    t = model = t + mixer
                for s in tail_all:
                    t += s
                for s in tail_model:
                    model += s
                start = now
                now = start + t
                end_at(now)
                total_at(t)
                model_at(model)
                n += 1
            # The host path is the same at every context.
            hosts.extend(hosts1 * n)
            return n, start, now, ctx

        return run

    def async_decode_run(self, num_decodes: int, overlaps: bool) -> AsyncDecodeRunFn | None:
        """An async decode-run clock (see ``async_decode_run_of``) with ``decode_run``'s arithmetic unrolled.

        None when the tails are too long to unroll (the generic clock then steps ``decode_step_parts``).
        """
        terms = self._decode_terms(num_decodes)
        tail_model = terms[3]
        if len(tail_model) > _UNROLLED:
            return None
        return _unrolled_async_decode_run(num_decodes, terms, tail_model, overlaps)

    def _decode_terms(self, d: int) -> tuple:
        """What a one-token decode step of ``d`` requests costs apart from its attention core."""
        batch = BatchShape(d, d, 0, 0, 0, d, 0, 0)
        mode = self.launch_mode(batch)
        key = (d, d, d, mode)
        ops = self._shape_ops.get(key)
        if ops is None:
            ops = self._shape_ops[key] = self._split_ops(batch, mode)
        before, after = ops
        # A hybrid model's mixers cost the same at every context.
        mixer = (
            _roof_seconds(*self._mamba_mixer(batch), self.attn_rate, self.mem_rate)
            if self.mamba_linear_params
            else None
        )
        # The sums that do not involve the attention time are the same at
        # every context: taken once, in step_parts' order. Up to the attention
        # core the step and model sums add the same terms, so they are equal.
        head = 0.0
        for s in before:
            head += s
        host = 0.0
        for s, on_host in after:
            if on_host:
                host += s
        tail_all = tuple(s for s, _ in after)
        tail_model = tuple(s for s, on_host in after if not on_host)
        return (
            head,
            host,
            tail_all,
            tail_model,
            mixer,
            self.decode_pair_flops,
            self.kv_token_bytes,
            self.qo_token_bytes,
            self.attn_rate,
            self.kv_read_rate,
            self._decode_fixed_s(d),
            None if self.kfit is None else self.kv_piece,
        )

    def _split_ops(self, batch: BatchShape, mode: int) -> _ShapeOps:
        """The seconds of the ops before the attention cores, and (seconds, host?) of those after."""
        if len(self._shape_ops) >= _MAX_SHAPES:
            self._shape_ops.clear()
        before: list[float] = []
        after: list[tuple[float, bool]] = []
        for op in self._ops(batch, None, mode):
            name = op[0]
            if name in _ATTENTION_CORES or name == "lora" or name == "mamba_mixer":
                continue
            if after or name not in _BEFORE_ATTENTION:
                after.append((op[4], name in HOST_OPS))
            else:
                if name in HOST_OPS:
                    raise AssertionError(f"{name} is host work ahead of the attention cores")
                before.append(op[4])
        return tuple(before), tuple(after)

    def step_time_in_group(self, batch: BatchShape, group_tokens: int, mode: int | None = None) -> float:
        """Seconds of one rank's step when its EP group runs ``group_tokens`` tokens, launched in ``mode``."""
        if batch.num_tokens == 0:
            return 0.0
        t = 0.0
        for op in self._ops(batch, group_tokens, mode):
            t += op[4]
        return t

    def describe(self) -> str:
        """One line: model, hardware, parallelism, efficiencies."""
        e = self.efficiency
        dp = self.parallel.data_parallel_size
        par = (f"DP={dp}, " if dp > 1 else "") + f"TP={self.tp}" + (f", EP={self.ep}" if self.ep > 1 else "")
        gemm = "by rows (measured)" if self._gemm_curve else e.gemm
        attention = "by keys per query (measured)" if self._attn_curve else e.attention
        return (
            f"{self.model.name} on {self.tp * dp}x {self.hardware.name} ({par}); efficiencies gemm {gemm}, "
            f"attention {attention}, memory {e.memory}, network {e.network}; "
            f"step overhead {self.step_overhead_s * 1e3:g} ms; {self.describe_launches()}"
        )

    def describe_launches(self) -> str:
        """One phrase: CUDA-graph size limit and what eager and piecewise steps add."""
        graphs = (
            f"CUDA graphs up to {self.cuda_graph_max_tokens} tokens"
            if self.cuda_graph_max_tokens
            else "no CUDA graphs"
        )
        return (
            f"{graphs}, {self.launch_latency_s * 1e6:g} us per launch: eager steps +"
            f"{self.eager_launch_s * 1e3:.2f} ms ({self.eager_launches:g} launches), piecewise +"
            f"{self.piecewise_launch_s * 1e3:.2f} ms"
        )
