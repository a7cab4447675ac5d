"""GPU memory planning: weights, activations, and the KV cache blocks that fit.

As vLLM does at start-up: the engine may use ``gpu_memory_utilization`` of
each GPU; weights, the peak activation of a ``max_num_batched_tokens`` step
and a fixed runtime reserve come off first; the rest is cut into KV blocks.
Configurations that could not start fail here, before any simulation, with
the numbers that do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.hardware import GiB, HardwareProfile
from llmsched.executor.sim.model_shapes import ModelShape

# CUDA context, NCCL buffers and CUDA-graph pools: memory the process holds
# outside the PyTorch allocator.
RUNTIME_RESERVE_BYTES = 1 * GiB


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Per-GPU memory budget and the resulting KV cache size."""

    device_bytes: float
    gpu_memory_utilization: float
    weight_bytes: float
    activation_bytes: float
    reserve_bytes: float
    kv_cache_bytes: float
    kv_bytes_per_token: float
    block_size: int
    # Counts the null block, like SchedulerConfig.num_gpu_blocks.
    num_gpu_blocks: int
    num_gpu_blocks_overridden: bool
    max_model_len: int
    # One request's Mamba state, all Mamba layers (0: not a hybrid model).
    mamba_state_bytes: float = 0.0

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the usable blocks hold."""
        return (self.num_gpu_blocks - 1) * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the cache holds at once (each with its state block, if hybrid)."""
        if self.mamba_state_bytes:
            per_request = -(-self.max_model_len // self.block_size) + 1
            return (self.num_gpu_blocks - 1) / per_request
        return self.kv_cache_tokens / self.max_model_len

    def to_dict(self) -> dict:
        """JSON-ready summary (GiB figures rounded)."""
        return {
            "device_gib": round(self.device_bytes / GiB, 2),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "weights_gib_per_gpu": round(self.weight_bytes / GiB, 2),
            "activation_gib": round(self.activation_bytes / GiB, 2),
            "reserve_gib": round(self.reserve_bytes / GiB, 2),
            "kv_cache_gib": round(self.kv_cache_bytes / GiB, 2),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_gpu_blocks_overridden": self.num_gpu_blocks_overridden,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_model_len": self.max_model_len,
            "max_concurrency": round(self.max_concurrency, 2),
            **(
                {"mamba_state_mib": round(self.mamba_state_bytes / 2**20, 2)}
                if self.mamba_state_bytes
                else {}
            ),
        }


def mamba_state_bytes(model: ModelShape, tp: int) -> float:
    """Bytes of one request's Mamba state on one GPU, conv and SSM over all Mamba layers (0: not hybrid)."""
    if not model.is_hybrid:
        return 0.0
    return model.num_mamba_layers * model.mamba_state_elements_per_layer(tp) * model.dtype_bytes


def hybrid_block_size(model: ModelShape, tp: int, block_size: int, kv_cache_dtype_bytes: float | None) -> int:
    """A hybrid model's block size: ``block_size`` doubled while an attention block stays within a state.

    vLLM raises a hybrid model's attention block size until an attention
    page is about as large as a Mamba state page, so one pool of equal
    pages serves both; here the scheduler keeps a single state group (one
    block per state, all Mamba layers), so a block's bytes are the larger of
    the two (``plan_memory``) and its size stays a power of two: the
    largest whose attention block is no larger than a state, which keeps
    the padding of attention blocks under half a page and prefill chunks
    (which end on block boundaries with prefix caching) short.
    """
    state = mamba_state_bytes(model, tp)
    if not state:
        return block_size
    kv_bytes = kv_cache_dtype_bytes if kv_cache_dtype_bytes else model.dtype_bytes
    per_token = model.num_attention_layers * model.kv_elements_per_token_layer(tp) * kv_bytes
    while per_token * block_size * 2 <= state:
        block_size *= 2
    return block_size


def weight_bytes_per_gpu(model: ModelShape, tp: int, ep: int | None = None) -> float:
    """Weights one TP rank holds: sharded linears split, replicated ones whole.

    ``ep``: GPUs the routed experts are spread over when that group is wider
    than TP (experts shared by data-parallel ranks); None means TP.
    """
    total = model.weight_bytes_total()
    if ep is not None and ep > tp and model.is_moe:
        experts = model.num_moe_layers * model.num_experts * model.expert_params() * model.weight_bytes
        # The experts leave the TP split and are counted at their own width.
        return weight_bytes_per_gpu(model, tp) - experts / tp + experts / ep
    replicated = 0.0
    for _, fin, fout, sharded in model.attention_linears():
        if not sharded:
            replicated += model.num_attention_layers * fin * fout * model.weight_bytes
    replicated += model.norm_params() * model.dtype_bytes
    replicated += model.num_moe_layers * model.router_params() * model.dtype_bytes
    if model.num_kv_heads < tp and not model.is_mla:
        # KV heads are copied, not split, once TP exceeds them.
        kv_w = 2 * model.hidden_size * model.head_dim * model.weight_bytes * model.num_attention_layers
        extra = kv_w * (model.kv_heads_per_gpu(tp) - model.num_kv_heads / tp)
        return (total - replicated) / tp + replicated + extra
    return (total - replicated) / tp + replicated


def activation_bytes(model: ModelShape, tp: int, max_num_batched_tokens: int, max_num_seqs: int) -> float:
    """Peak activation memory of the largest step, as vLLM's profiling run sees it.

    The widest live tensors of a layer (residual, hidden, the gate/up output)
    for a full token budget, plus fp32 logits for ``max_num_seqs`` samples.
    """
    width = max(model.intermediate_size, model.moe_intermediate_size * max(model.num_experts_per_tok, 1))
    per_token = (4 * model.hidden_size + 2 * width / tp + model.q_dim / tp) * model.dtype_bytes
    return max_num_batched_tokens * per_token + max_num_seqs * model.vocab_size / tp * 4


def plan_memory(
    model: ModelShape,
    hardware: HardwareProfile,
    *,
    tensor_parallel_size: int = 1,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    max_model_len: int | None = None,
    kv_cache_dtype_bytes: float | None = None,
    num_gpu_blocks: int | None = None,
    expert_parallel_size: int | None = None,
    draft_model: ModelShape | None = None,
) -> MemoryPlan:
    """Size the KV cache; raise ConfigError (with the numbers) when it cannot work.

    ``draft_model``: a speculative-decoding draft model on the same GPUs; its
    weights come off the budget and its KV shares every block (per-token
    bytes add up), as in vLLM.
    """
    tp = tensor_parallel_size
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    derived = model.max_position_embeddings
    if max_model_len is None:
        max_model_len = derived
    elif max_model_len > derived:
        raise ConfigError(
            f"max_model_len={max_model_len} is greater than the model's maximum context length "
            f"({derived}, max_position_embeddings of {model.name})"
        )
    budget = hardware.mem_capacity * gpu_memory_utilization
    weights = weight_bytes_per_gpu(model, tp, expert_parallel_size)
    if draft_model is not None:
        weights += weight_bytes_per_gpu(draft_model, tp)
    acts = activation_bytes(model, tp, max_num_batched_tokens, max_num_seqs)
    reserve = RUNTIME_RESERVE_BYTES if hardware.mem_capacity > 16 * GiB else 0.05 * hardware.mem_capacity
    if weights + acts + reserve >= budget:
        ep = expert_parallel_size
        where = f" per data-parallel rank, experts over {ep} GPUs," if ep is not None and ep > tp else ""
        raise ConfigError(
            f"{model.name} does not fit on {tp}x {hardware.name}{where}: each GPU needs "
            f"{weights / GiB:.2f} GiB of "
            f"weights + {acts / GiB:.2f} GiB of activations + {reserve / GiB:.2f} GiB runtime reserve = "
            f"{(weights + acts + reserve) / GiB:.2f} GiB, but gpu_memory_utilization "
            f"{gpu_memory_utilization} x {hardware.mem_capacity / GiB:.2f} GiB allows "
            f"{budget / GiB:.2f} GiB; "
            "raise --tensor-parallel-size or --gpu-memory-utilization, or pick a larger GPU"
        )
    kv_bytes = kv_cache_dtype_bytes if kv_cache_dtype_bytes else model.dtype_bytes
    per_token = model.num_attention_layers * model.kv_elements_per_token_layer(tp) * kv_bytes
    if draft_model is not None:
        per_token += draft_model.num_layers * draft_model.kv_elements_per_token_layer(tp) * kv_bytes
    # A hybrid model's Mamba state block shares the pool: every block is
    # sized to hold the larger of an attention block and one request's state.
    state = mamba_state_bytes(model, tp)
    block_bytes = max(per_token * block_size, state)
    kv_avail = budget - weights - acts - reserve
    overridden = num_gpu_blocks is not None
    blocks = num_gpu_blocks if overridden else int(kv_avail // block_bytes)
    need = -(-max_model_len // block_size)
    if blocks - 1 < need:
        if overridden:
            raise ConfigError(
                f"max_model_len={max_model_len} needs {need} KV blocks of {block_size} tokens, but "
                f"--num-gpu-blocks={blocks} leaves {blocks - 1} usable; lower --max-model-len or raise "
                "--num-gpu-blocks"
            )
        fit_len = max(blocks - 1, 0) * block_size
        raise ConfigError(
            f"max_model_len={max_model_len} needs {need * block_bytes / GiB:.2f} GiB of KV cache "
            f"({per_token / 1024:.1f} KiB per token) but only {kv_avail / GiB:.2f} GiB is left per GPU after "
            f"{weights / GiB:.2f} GiB of weights and {(acts + reserve) / GiB:.2f} GiB of activations and "
            f"reserve; the KV cache holds {fit_len} tokens. Lower --max-model-len (at most {fit_len}), or "
            "raise --gpu-memory-utilization or --tensor-parallel-size"
        )
    return MemoryPlan(
        device_bytes=hardware.mem_capacity,
        gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=weights,
        activation_bytes=acts,
        reserve_bytes=reserve,
        kv_cache_bytes=max(kv_avail, 0.0),
        kv_bytes_per_token=per_token,
        block_size=block_size,
        num_gpu_blocks=blocks,
        num_gpu_blocks_overridden=overridden,
        max_model_len=max_model_len,
        mamba_state_bytes=state,
    )
