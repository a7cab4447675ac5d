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
  preparation, launch gaps, output processing) with CUDA graphs on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Protocol

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.hardware import HardwareProfile
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
        if not spec:
            return cls()
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
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Parallelism:
    """How one engine's model is split over GPUs."""

    tensor_parallel_size: int = 1
    # Experts are spread over the TP group (each GPU holds whole experts)
    # instead of every GPU holding a 1/TP slice of every expert.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size={tp!r} must be a positive integer")


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
                b.prefill_tokens += n
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


class StepCostModel(Protocol):
    """Anything that prices a step."""

    def step_time(self, batch: BatchShape) -> float:
        """Seconds the step takes."""
        ...


class ConstantCostModel:
    """Every step takes the same time: a step-clocked simulation (tests, what-ifs)."""

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds

    def step_time(self, batch: BatchShape) -> float:
        """The constant."""
        return self.seconds


class CostModel:
    """Roofline time of one step of ``model`` on ``hardware`` under ``parallel``."""

    def __init__(
        self,
        model: ModelShape,
        hardware: HardwareProfile,
        parallel: Parallelism | None = None,
        efficiency: Efficiency | None = None,
        step_overhead_s: float = 5e-4,
        kv_cache_dtype_bytes: float | None = None,
    ) -> None:
        self.model = model
        self.hardware = hardware
        self.parallel = parallel or Parallelism()
        self.efficiency = efficiency or Efficiency()
        if step_overhead_s < 0:
            raise ConfigError(f"step_overhead_s={step_overhead_s} must be >= 0")
        self.step_overhead_s = step_overhead_s
        m, hw, eff = model, hardware, self.efficiency
        tp = self.tp = self.parallel.tensor_parallel_size
        ep_on = self.parallel.enable_expert_parallel and m.is_moe
        self.ep = tp if ep_on else 1
        self.act_bytes = m.dtype_bytes
        self.kv_bytes = kv_cache_dtype_bytes if kv_cache_dtype_bytes else m.dtype_bytes
        self.gemm_rate = hw.gemm_peak(m.fp8_weights) * eff.gemm
        self.attn_rate = hw.peak_flops_bf16 * eff.attention
        self.mem_rate = hw.mem_bandwidth * eff.memory
        self.link_rate = hw.link_bandwidth * eff.network
        self.latency = hw.collective_latency_s
        self._precompute()

    def _precompute(self) -> None:
        m, tp, a = self.model, self.tp, self.act_bytes
        L = m.num_layers
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
        self.attn_linear_io = L * attn_io * a
        # Dense MLP layers.
        ld = m.num_mlp_dense_layers
        self.mlp_params = ld * m.dense_mlp_params() / tp
        self.mlp_io = ld * (2 * m.hidden_size + 3 * m.intermediate_size / tp) * a
        # Attention core: FLOPs per (query, key) pair and KV bytes per token, all layers.
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
        self.elementwise_token_bytes = a * (
            L * (_ELEMENTWISE_HIDDEN_PASSES * m.hidden_size + _ROPE_PASSES * rope_width)
            + _ACTIVATION_PASSES * (ld * m.intermediate_size / tp + m.num_moe_layers * moe_width)
        )
        # Embedding (vocab-parallel lookup) and LM head (vocab-parallel).
        self.lm_head_params = m.vocab_size * m.hidden_size / tp
        self.vocab_per_gpu = m.vocab_size / tp

    # ---- the ops of one step ---------------------------------------------------

    def _ops(self, b: BatchShape) -> list[tuple[str, float, float, float, float, str]]:
        """(name, flops, bytes, comm_bytes, seconds, bound) per op; one code path for all callers."""
        m = self.model
        T = b.num_tokens
        S = b.num_sampled
        wb, a = m.weight_bytes, self.act_bytes
        gemm, attn, mem = self.gemm_rate, self.attn_rate, self.mem_rate
        ops: list[tuple[str, float, float, float, float, str]] = []

        def roof(name: str, flops: float, nbytes: float, rate: float) -> None:
            tc, tm = flops / rate, nbytes / mem
            ops.append((name, flops, nbytes, 0.0, tc if tc > tm else tm, "compute" if tc > tm else "memory"))

        def comm(name: str, n: int, nbytes: float) -> None:
            ops.append((name, 0.0, 0.0, nbytes, n * self.latency + nbytes / self.link_rate, "network"))

        if T == 0:
            return ops
        h = m.hidden_size
        roof("embedding", 0.0, 2 * T * h * a, mem)
        p = self.attn_linear_params
        roof("attention_linears", 2 * T * p, p * wb + T * self.attn_linear_io, gemm)
        if b.prefill_tokens:
            roof(
                "attention_prefill",
                b.prefill_pairs * self.prefill_pair_flops + b.prefill_context * self.context_upproj_flops,
                (b.prefill_context + 2 * b.prefill_tokens) * self.kv_token_bytes
                + b.prefill_tokens * self.qo_token_bytes,
                attn,
            )
        if b.num_decodes:
            roof(
                "attention_decode",
                b.decode_context * self.decode_pair_flops,
                (b.decode_context + b.num_decodes) * self.kv_token_bytes
                + b.num_decodes * self.qo_token_bytes,
                attn,
            )
        if self.mlp_params:
            p = self.mlp_params
            roof("mlp", 2 * T * p, p * wb + T * self.mlp_io, gemm)
        if m.is_moe:
            self._moe_ops(T, roof, comm)
        roof(
            "norms_activations",
            2 * T * self.elementwise_token_bytes / a,
            T * self.elementwise_token_bytes,
            mem,
        )
        if S:
            p = self.lm_head_params
            roof("lm_head", 2 * S * p, p * m.dtype_bytes + S * self.vocab_per_gpu * _LOGIT_BYTES, gemm)
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
        return ops

    def _moe_ops(self, T: int, roof: _Roof, comm: _Comm) -> None:
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
        assignments = T * k
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
            # Dispatch and combine: each rank sends its 1/EP of the tokens'
            # top-k copies to the experts' owners and gets them back, then
            # the hidden states are all-gathered across the group.
            a2a = (T / ep) * k * h * a * (ep - 1) / ep
            gather = T * h * a * (ep - 1) / ep
            comm("ep_all_to_all", 3 * L, L * (2 * a2a + gather))

    # ---- public ----------------------------------------------------------------

    def ops(self, batch: BatchShape) -> list[OpCost]:
        """The step's operations with their FLOPs, bytes, seconds and what bounds them."""
        return [OpCost(*op) for op in self._ops(batch)]

    def step_time(self, batch: BatchShape) -> float:
        """Seconds one step takes on the virtual clock (0 for an empty batch)."""
        if batch.num_tokens == 0:
            return 0.0
        t = 0.0
        for op in self._ops(batch):
            t += op[4]
        return t

    def describe(self) -> str:
        """One line: model, hardware, parallelism, efficiencies."""
        e = self.efficiency
        par = f"TP={self.tp}" + (f", EP={self.ep}" if self.ep > 1 else "")
        return (
            f"{self.model.name} on {self.tp}x {self.hardware.name} ({par}); efficiencies gemm {e.gemm}, "
            f"attention {e.attention}, memory {e.memory}, network {e.network}; "
            f"step overhead {self.step_overhead_s * 1e3:g} ms"
        )
