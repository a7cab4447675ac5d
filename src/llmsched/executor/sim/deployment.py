"""A simulated deployment: engine arguments resolved into model, hardware, KV cache and costs.

Defaults follow vLLM's engine arguments for an API server on the chosen
hardware (``max_num_batched_tokens`` and ``max_num_seqs`` by device class,
``max_model_len`` from the model, the KV cache from the memory left), so a
simulated run starts from what ``vllm serve`` would have done.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import ConfigError
from llmsched.executor.sim.cost_model import CostModel, Efficiency, Parallelism
from llmsched.executor.sim.hardware import GiB, HardwareProfile, load_hardware
from llmsched.executor.sim.memory import MemoryPlan, plan_memory
from llmsched.executor.sim.model_shapes import ModelShape, load_model

KV_CACHE_DTYPES = {
    "auto": None,
    "bfloat16": 2.0,
    "float16": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
}
QUANTIZATIONS = (None, "fp8")


@dataclass(slots=True)
class DeploymentSpec:
    """What a user asks for, with vLLM's engine-argument names; None means vLLM's default."""

    model: str = "llama-3-8b"
    hardware: str = "h100"
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # "auto": xxh3_128 when the xxhash package is installed, else sha256.
    # The hash only names cached blocks; decisions do not depend on it.
    prefix_caching_hash_algo: str = "auto"
    efficiency: Efficiency = field(default_factory=Efficiency)
    step_overhead_ms: float = 0.5
    recalibrate: bool = False


@dataclass(slots=True)
class Deployment:
    """Everything a simulation needs, resolved and checked."""

    spec: DeploymentSpec
    model: ModelShape
    hardware: HardwareProfile
    memory: MemoryPlan
    scheduler_config: SchedulerConfig
    cost_model: CostModel

    def describe(self) -> list[str]:
        """Human-readable lines: model, hardware, memory, scheduler knobs."""
        s, m, c = self.spec, self.memory, self.scheduler_config
        par = f"TP={s.tensor_parallel_size}" + (", EP" if self.cost_model.ep > 1 else "")
        blocks = f"{m.num_gpu_blocks} blocks" + (" (--num-gpu-blocks)" if m.num_gpu_blocks_overridden else "")
        return [
            f"model      {self.model.summary()}",
            f"hardware   {s.tensor_parallel_size}x {self.hardware.description} ({par})",
            f"memory     {m.weight_bytes / GiB:.2f} GiB weights/GPU, KV cache {blocks} x {c.block_size} "
            f"tokens = {m.kv_cache_tokens} tokens, {m.max_concurrency:.2f}x concurrency at max_model_len "
            f"{c.max_model_len}",
            f"scheduler  max_num_batched_tokens {c.max_num_batched_tokens}, max_num_seqs {c.max_num_seqs}, "
            f"policy {c.policy}, prefix caching {'on' if c.enable_prefix_caching else 'off'}, "
            f"chunked prefill {'on' if c.enable_chunked_prefill else 'off'}",
        ]

    def to_dict(self) -> dict:
        """JSON-ready description of the resolved deployment."""
        return {
            "model": self.model.name,
            "model_params": self.model.num_params(),
            "hardware": self.hardware.name,
            "tensor_parallel_size": self.spec.tensor_parallel_size,
            "enable_expert_parallel": self.cost_model.ep > 1,
            "memory": self.memory.to_dict(),
            "scheduler": self.scheduler_config.to_dict(),
            "efficiency": {
                "gemm": self.cost_model.efficiency.gemm,
                "attention": self.cost_model.efficiency.attention,
                "memory": self.cost_model.efficiency.memory,
                "network": self.cost_model.efficiency.network,
            },
            "step_overhead_ms": self.spec.step_overhead_ms,
        }


def resolve_hash_algo(name: str) -> str:
    """The prefix-cache hash to use: 'auto' picks the fastest one installed."""
    if name != "auto":
        return name
    try:
        import xxhash  # noqa: F401 - only probing
    except ImportError:
        return "sha256"
    return "xxh3_128"


def build_deployment(spec: DeploymentSpec) -> Deployment:
    """Resolve defaults, size the KV cache and build the cost model; ConfigError if impossible."""
    model = load_model(spec.model)
    hw = load_hardware(spec.hardware, recalibrate=spec.recalibrate)
    if spec.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype={spec.kv_cache_dtype!r} is unknown; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if spec.quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization={spec.quantization!r} is not supported; choose fp8 or leave it unset"
        )
    if spec.quantization == "fp8" and model.weight_bytes > 1.0:
        model = replace(model, weight_bytes=1.0)
    tp = spec.tensor_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor_parallel_size={tp!r} must be a positive integer")
    if model.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} must divide the number of attention heads ({model.num_heads})"
        )
    if spec.enable_expert_parallel and model.is_moe and model.num_experts % tp:
        raise ConfigError(
            f"expert parallelism over {tp} GPUs needs num_experts ({model.num_experts}) divisible by it"
        )
    # vLLM scales the CPU defaults with the world size.
    scale = tp if hw.name == "cpu" else 1
    budget = spec.max_num_batched_tokens
    seqs = spec.max_num_seqs if spec.max_num_seqs is not None else hw.default_max_num_seqs * scale
    kv_bytes = KV_CACHE_DTYPES[spec.kv_cache_dtype]
    max_len = spec.max_model_len if spec.max_model_len is not None else model.max_position_embeddings
    if budget is None:
        budget = hw.default_max_num_batched_tokens * scale
        if not spec.enable_chunked_prefill:
            budget = max(budget, max_len)
        budget = max(budget, seqs)
    memory = plan_memory(
        model,
        hw,
        tensor_parallel_size=tp,
        block_size=spec.block_size,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=spec.max_model_len,
        kv_cache_dtype_bytes=kv_bytes,
        num_gpu_blocks=spec.num_gpu_blocks,
    )
    config = SchedulerConfig(
        num_gpu_blocks=memory.num_gpu_blocks,
        max_model_len=memory.max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        block_size=spec.block_size,
        enable_prefix_caching=spec.enable_prefix_caching,
        prefix_caching_hash_algo=resolve_hash_algo(spec.prefix_caching_hash_algo),
        enable_chunked_prefill=spec.enable_chunked_prefill,
        long_prefill_token_threshold=spec.long_prefill_token_threshold,
        policy=spec.scheduling_policy,
    )
    if spec.step_overhead_ms < 0:
        raise ConfigError(f"step_overhead_ms={spec.step_overhead_ms} must be >= 0")
    cost = CostModel(
        model,
        hw,
        Parallelism(tp, spec.enable_expert_parallel),
        spec.efficiency,
        step_overhead_s=spec.step_overhead_ms / 1000.0,
        kv_cache_dtype_bytes=kv_bytes,
    )
    return Deployment(spec, model, hw, memory, config, cost)
