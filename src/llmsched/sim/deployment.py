"""A simulated deployment: engine arguments resolved into model, hardware, KV cache and costs.

Defaults follow vLLM's engine arguments for an API server on the chosen
hardware (``max_num_batched_tokens`` and ``max_num_seqs`` by device class,
``max_model_len`` from the model, the KV cache from the memory left), so a
simulated run starts from what ``vllm serve`` would have done.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import ConfigError
from llmsched.engine.batch_defaults import parse_usage_context, resolve_batch_limits
from llmsched.executor.sim.cost_model import CostModel, Efficiency, Parallelism
from llmsched.executor.sim.hardware import GiB, HardwareProfile
from llmsched.executor.sim.memory import MemoryPlan, hybrid_block_size, plan_memory
from llmsched.executor.sim.model_shapes import ModelShape, load_model
from llmsched.executor.sim.spec_decode import SimSpecDecode, parse_sim_speculative_config
from llmsched.sim.calibrate import load_hardware

KV_CACHE_DTYPES = {
    "auto": None,
    "bfloat16": 2.0,
    "float16": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
}
QUANTIZATIONS = (None, "fp8")
# Auto-chosen tensor parallelism stops here (two 8-GPU nodes per rank).
_MAX_AUTO_TP = 16


@dataclass(slots=True)
class DeploymentSpec:
    """What a user asks for, with vLLM's engine-argument names; None means vLLM's default."""

    model: str = "llama-3-8b"
    hardware: str = "h100"
    # None: the smallest power of two that divides the heads and fits the weights.
    tensor_parallel_size: int | None = 1
    enable_expert_parallel: bool = False
    # Engine ranks, each with TP GPUs; a MoE model's experts are then spread
    # over all DP x TP GPUs (expert parallelism is implied).
    data_parallel_size: int = 1
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
    policy_config: dict | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # "auto": xxh3_128 when the xxhash package is installed, else sha256.
    # The hash only names cached blocks; decisions do not depend on it.
    prefix_caching_hash_algo: str = "auto"
    # An Efficiency, or a dict of overrides on the hardware's defaults (the
    # measured cpu profile has its own); None: the hardware's defaults.
    efficiency: Efficiency | dict | None = None
    # None: the hardware profile's measured step overhead, else 0.5 ms.
    step_overhead_ms: float | None = None
    # The largest step a CUDA graph is captured for (vLLM's
    # max_cudagraph_capture_size); None: vLLM's default, 2 x max_num_seqs
    # capped at 512 and at max_num_batched_tokens (0 on hardware without
    # CUDA graphs); 0: no graphs.
    cuda_graph_max_tokens: int | None = None
    # Per eager kernel launch; None: the hardware profile's kernel_launch_s.
    launch_latency_us: float | None = None
    # Eager kernel launches per decoder layer; None: counted from the model.
    kernels_per_layer: float | None = None
    # LoRA: at most this many adapters per step (None: LoRA off, adapters
    # ignored), each priced at max_lora_rank (vLLM's padded kernels).
    max_loras: int | None = None
    max_lora_rank: int = 16
    # Plan each step while the previous one runs (vLLM's AsyncScheduler and
    # batch queue): a step's host path then overlaps the other step's model
    # time. vLLM 0.33 turns it on by default and `llmsched simulate` does
    # too; here it stays off unless asked, so a deployment built from the
    # library keeps pricing steps as it always has. Single-engine only: the
    # data-parallel simulation runs its ranks sync.
    async_scheduling: bool = False
    recalibrate: bool = False
    # Whose defaults the batch limits take (engine/batch_defaults.py):
    # `vllm serve`'s unless asked otherwise (LLM_CLASS: the offline LLM).
    usage_context: str = "OPENAI_API_SERVER"
    # Speculative decoding: vLLM's --speculative-config JSON (a dict or its
    # text) plus the simulator's acceptance keys (executor/sim/spec_decode.py);
    # spec_acceptance ("0.7" or "0.8,0.6,0.4") overrides the JSON's rates.
    speculative_config: dict | str | None = None
    spec_acceptance: str | float | list | None = None


@dataclass(slots=True)
class Deployment:
    """Everything a simulation needs, resolved and checked."""

    spec: DeploymentSpec
    model: ModelShape
    hardware: HardwareProfile
    memory: MemoryPlan
    scheduler_config: SchedulerConfig
    cost_model: CostModel
    # True when TP was chosen because the spec left it to us.
    tensor_parallel_auto: bool = False
    # Speculative decoding's acceptance draws and drafting costs (None: off).
    spec_decode: SimSpecDecode | None = None

    @property
    def data_parallel_size(self) -> int:
        """Engine ranks (1 without data parallelism)."""
        return self.spec.data_parallel_size

    @property
    def num_gpus(self) -> int:
        """GPUs of the whole deployment."""
        return self.cost_model.tp * self.spec.data_parallel_size

    def describe(self) -> list[str]:
        """Human-readable lines: model, hardware, memory, scheduler knobs."""
        s, m, c = self.spec, self.memory, self.scheduler_config
        cm = self.cost_model
        par = (f"DP={s.data_parallel_size} x " if s.data_parallel_size > 1 else "") + f"TP={cm.tp}"
        if self.tensor_parallel_auto:
            par += " (the smallest TP that fits the weights; set --tensor-parallel-size to choose)"
        if cm.ep > 1:
            par += f", EP={cm.ep}"
        blocks = f"{m.num_gpu_blocks} blocks" + (" (--num-gpu-blocks)" if m.num_gpu_blocks_overridden else "")
        if m.mamba_state_bytes:
            blocks += (
                f" (each holds one request's {m.mamba_state_bytes / 2**20:.1f} MiB Mamba state or "
                f"{c.block_size} tokens' KV; block size raised from {s.block_size} to match a state)"
                if c.block_size != s.block_size
                else f" (each holds one request's {m.mamba_state_bytes / 2**20:.1f} MiB Mamba state or KV)"
            )
        per_rank = " per rank" if s.data_parallel_size > 1 else ""
        return [
            f"model      {self.model.summary()}",
            f"hardware   {self.num_gpus}x {self.hardware.description} ({par})",
            f"memory     {m.weight_bytes / GiB:.2f} GiB weights/GPU, KV cache{per_rank} {blocks} x "
            f"{c.block_size} "
            f"tokens = {m.kv_cache_tokens} tokens, {m.max_concurrency:.2f}x concurrency at max_model_len "
            f"{c.max_model_len}",
            f"scheduler  max_num_batched_tokens {c.max_num_batched_tokens}, max_num_seqs {c.max_num_seqs}"
            f"{per_rank}, "
            f"policy {c.policy}, prefix caching {'on' if c.enable_prefix_caching else 'off'}, "
            f"chunked prefill {'on' if c.enable_chunked_prefill else 'off'}, "
            f"async scheduling {'on' if c.async_scheduling else 'off'}",
            f"launches   {cm.describe_launches()}",
            *self._describe_spec(),
        ]

    def _describe_spec(self) -> list[str]:
        sd = self.spec_decode
        if sd is None:
            return []
        c = sd.config
        how = f"draft model {sd.draft_name}" if c.method == "draft_model" else "n-gram prompt lookup"
        rates = ", ".join(f"{r:g}" for r in sd.acceptance.rates)
        return [
            f"speculate  {how}, K={sd.k}, acceptance per draft token {rates} (seed {sd.seed}): "
            f"expected {1 + sd.acceptance.expected_accepted(sd.k):.2f} tokens per verifying step"
        ]

    def to_dict(self) -> dict:
        """JSON-ready description of the resolved deployment."""
        return {
            "model": self.model.name,
            "model_params": self.model.num_params(),
            "hardware": self.hardware.name,
            "tensor_parallel_size": self.cost_model.tp,
            "data_parallel_size": self.spec.data_parallel_size,
            "expert_parallel_size": self.cost_model.ep,
            "enable_expert_parallel": self.cost_model.ep > 1,
            "memory": self.memory.to_dict(),
            "scheduler": self.scheduler_config.to_dict(),
            "efficiency": {
                "gemm": self.cost_model.efficiency.gemm,
                "attention": self.cost_model.efficiency.attention,
                "memory": self.cost_model.efficiency.memory,
                "network": self.cost_model.efficiency.network,
            },
            "step_overhead_ms": self.cost_model.step_overhead_s * 1e3,
            "speculative_config": None if self.spec_decode is None else self.spec_decode.to_dict(),
            "launch": {
                "cuda_graph_max_tokens": self.cost_model.cuda_graph_max_tokens,
                "launch_latency_us": self.cost_model.launch_latency_s * 1e6,
                "eager_launches_per_step": self.cost_model.eager_launches,
                "piecewise_launches_per_step": self.cost_model.piecewise_launches,
                "eager_step_extra_ms": self.cost_model.eager_launch_s * 1e3,
                "piecewise_step_extra_ms": self.cost_model.piecewise_launch_s * 1e3,
            },
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


def resolve_efficiency(efficiency: Efficiency | dict | None, hw: HardwareProfile) -> Efficiency:
    """The efficiencies to use: given whole, or overrides on the hardware's defaults."""
    if isinstance(efficiency, Efficiency):
        return efficiency
    return Efficiency(**{**(hw.efficiency or {}), **(efficiency or {})})


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
    dp = spec.data_parallel_size
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"data_parallel_size={dp!r} must be a positive integer")
    if not isinstance(spec.async_scheduling, bool):
        raise ConfigError(f"async_scheduling={spec.async_scheduling!r} must be true or false")
    if spec.async_scheduling and dp > 1:
        raise ConfigError(
            "async scheduling is simulated for one engine only: the data-parallel simulation runs "
            "its ranks sync (use --no-async-scheduling with --data-parallel-size > 1)"
        )
    # Data-parallel ranks of a MoE model share their experts: vLLM runs them
    # as one expert-parallel group over all DP x TP GPUs.
    ep_on = model.is_moe and (spec.enable_expert_parallel or dp > 1)
    if spec.tensor_parallel_size is None:
        return _build_smallest_tp(spec, model, hw, ep_on)
    tp = spec.tensor_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor_parallel_size={tp!r} must be a positive integer")
    return _build(spec, model, hw, tp, ep_on)


def _build_smallest_tp(
    spec: DeploymentSpec, model: ModelShape, hw: HardwareProfile, ep_on: bool
) -> Deployment:
    """The deployment at the smallest power-of-two TP whose weights fit."""
    error: ConfigError | None = None
    tp = 1
    while tp <= min(model.num_heads, _MAX_AUTO_TP):
        if model.num_heads % tp == 0:
            try:
                d = _build(spec, model, hw, tp, ep_on)
            except ConfigError as e:
                error = e
            else:
                d.spec = replace(spec, tensor_parallel_size=tp)
                d.tensor_parallel_auto = tp > 1
                return d
        tp *= 2
    assert error is not None
    raise error


def _batch_limits(spec: DeploymentSpec, hw: HardwareProfile, tp: int, max_len: int) -> tuple[int, int]:
    """The spec's batch limits, or vLLM 0.33's defaults for the hardware and usage context."""
    tokens = spec.max_num_batched_tokens
    seqs = spec.max_num_seqs
    # A profile may pin its own defaults; otherwise vLLM's table decides.
    if tokens is None and hw.default_max_num_batched_tokens is not None:
        tokens = hw.default_max_num_batched_tokens
    if seqs is None and hw.default_max_num_seqs is not None:
        seqs = hw.default_max_num_seqs
    limits = resolve_batch_limits(
        tokens,
        seqs,
        usage=parse_usage_context(spec.usage_context),
        platform=hw.platform(world_size=tp),
        max_model_len=max_len,
        enable_chunked_prefill=spec.enable_chunked_prefill,
    )
    return limits.max_num_batched_tokens, limits.max_num_seqs


def _build(spec: DeploymentSpec, model: ModelShape, hw: HardwareProfile, tp: int, ep_on: bool) -> Deployment:
    dp = spec.data_parallel_size
    if model.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} must divide the number of attention heads ({model.num_heads})"
        )
    ep = tp * dp if ep_on else 1
    if ep_on and model.num_experts % ep:
        raise ConfigError(
            f"expert parallelism over {ep} GPUs needs num_experts ({model.num_experts}) divisible by it"
        )
    kv_bytes = KV_CACHE_DTYPES[spec.kv_cache_dtype]
    settings = None
    draft = None
    if spec.speculative_config is not None:
        settings = parse_sim_speculative_config(spec.speculative_config, spec.spec_acceptance)
        if settings.draft_model is not None:
            draft = load_model(settings.draft_model)
            if draft.num_heads % tp:
                raise ConfigError(
                    f"tensor_parallel_size={tp} must divide the draft model's attention heads "
                    f"({draft.num_heads})"
                )
    elif spec.spec_acceptance is not None:
        raise ConfigError("--spec-acceptance needs --speculative-config")
    max_len = spec.max_model_len if spec.max_model_len is not None else model.max_position_embeddings
    budget, seqs = _batch_limits(spec, hw, tp, max_len)
    block_size = hybrid_block_size(model, tp, spec.block_size, kv_bytes)
    memory = plan_memory(
        model,
        hw,
        tensor_parallel_size=tp,
        block_size=block_size,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=spec.max_model_len,
        kv_cache_dtype_bytes=kv_bytes,
        num_gpu_blocks=spec.num_gpu_blocks,
        expert_parallel_size=ep if ep > tp else None,
        draft_model=draft,
    )
    k = settings.config.num_speculative_tokens if settings is not None else 0
    config = SchedulerConfig(
        num_gpu_blocks=memory.num_gpu_blocks,
        max_model_len=memory.max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        block_size=block_size,
        enable_prefix_caching=spec.enable_prefix_caching,
        prefix_caching_hash_algo=resolve_hash_algo(spec.prefix_caching_hash_algo),
        enable_chunked_prefill=spec.enable_chunked_prefill,
        long_prefill_token_threshold=spec.long_prefill_token_threshold,
        policy=spec.scheduling_policy,
        policy_config=spec.policy_config,
        async_scheduling=spec.async_scheduling,
        max_loras=spec.max_loras,
        mamba=model.is_hybrid,
        num_speculative_tokens=k,
        num_lookahead_tokens=settings.config.num_lookahead_tokens if settings is not None else 0,
    )
    if model.is_hybrid and spec.enable_prefix_caching and budget < block_size:
        # Align mode ends every chunk but a prompt's last on a block boundary.
        raise ConfigError(
            f"{model.name} runs with {block_size}-token blocks (a block holds a Mamba state) and prefix "
            "caching, "
            f"whose prefill chunks end on block boundaries: max_num_batched_tokens={budget} must be at least "
            f"{block_size}, or turn prefix caching off"
        )
    if spec.step_overhead_ms is not None and spec.step_overhead_ms < 0:
        raise ConfigError(f"step_overhead_ms={spec.step_overhead_ms} must be >= 0")
    graph_max = spec.cuda_graph_max_tokens
    if graph_max is None:
        # vLLM's _set_cudagraph_sizes: decodes of up to twice max_num_seqs, at
        # most 512 tokens, never more than one step's budget.
        graph_max = min(2 * seqs, 512, budget) if hw.cuda_graphs else 0
    if spec.launch_latency_us is not None and spec.launch_latency_us < 0:
        raise ConfigError(f"launch_latency_us={spec.launch_latency_us} must be >= 0")

    def cost_of(m: ModelShape, lora_rank: int) -> CostModel:
        return CostModel(
            m,
            hw,
            Parallelism(tp, ep_on, dp if ep_on else 1),
            resolve_efficiency(spec.efficiency, hw),
            step_overhead_s=None if spec.step_overhead_ms is None else spec.step_overhead_ms / 1000.0,
            kv_cache_dtype_bytes=kv_bytes,
            cuda_graph_max_tokens=graph_max,
            launch_latency_s=None if spec.launch_latency_us is None else spec.launch_latency_us / 1e6,
            kernels_per_layer=spec.kernels_per_layer,
            lora_rank=lora_rank,
        )

    cost = cost_of(model, spec.max_lora_rank if spec.max_loras else 0)
    spec_decode = None
    if settings is not None:
        spec_decode = SimSpecDecode(
            settings.config,
            settings.acceptance,
            settings.seed,
            draft_cost=cost_of(draft, 0) if draft is not None else None,
            ngram_s_per_request=settings.ngram_s_per_request,
            draft_name=settings.draft_model,
        )
    return Deployment(spec, model, hw, memory, config, cost, spec_decode=spec_decode)
