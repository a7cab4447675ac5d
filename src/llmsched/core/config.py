"""Scheduler and KV cache settings, validated when constructed."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

from llmsched.core.errors import ConfigError
from llmsched.core.kv.block_hash import HASH_ALGOS
from llmsched.core.policy import check_policy_name


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(kw_only=True)
class SchedulerConfig:
    """Every knob of the scheduler and its KV cache; names follow vLLM's.

    ``num_gpu_blocks`` counts the null block, so ``num_gpu_blocks - 1`` blocks
    hold tokens. Defaults follow vLLM: chunked prefill on, full-prompt
    reservation on, watermark 0, FCFS, block size 16, prefix caching on.
    """

    num_gpu_blocks: int
    max_model_len: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # The policy's knobs (see llmsched.core.policies); None: its defaults.
    policy_config: dict | None = None
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    # None: no LoRA slot limit. Otherwise at most this many distinct adapters
    # among running requests.
    max_loras: int | None = None
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    # With drafts, pad an admission with one token left to a full draft step
    # of placeholder drafts, as vLLM 0.33 schedules it (executors reject them).
    pad_draft_admissions: bool = True
    # Admit prefill only once every N executed steps while decodes run (vLLM's
    # prefill_schedule_interval); 1 admits prefill on every step.
    prefill_schedule_interval: int = 1
    # Plan each step while the previous one still runs, counting its
    # not-yet-sampled tokens as output placeholders (vLLM's AsyncScheduler).
    async_scheduling: bool = False
    # A hybrid model: a Mamba (state) group beside full attention on the same
    # block pool. With prefix caching, states are cached at block boundaries
    # and prefill chunks end on them (vLLM's "align" mode).
    mamba: bool = False
    # Multimodal: embeddings the encoder may compute per step, and the
    # encoder cache's size in embeddings (None: max_num_batched_tokens);
    # disable_chunked_mm_input forbids a chunk covering part of an item.
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    disable_chunked_mm_input: bool = False
    # Check the scheduling and KV invariants after every step (slow).
    debug: bool = False

    def __post_init__(self) -> None:
        if os.environ.get("LLMSCHED_DEBUG", "") not in ("", "0"):
            self.debug = True
        for name in (
            "num_gpu_blocks",
            "max_model_len",
            "max_num_batched_tokens",
            "max_num_seqs",
            "block_size",
        ):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        for name in ("long_prefill_token_threshold", "num_speculative_tokens", "num_lookahead_tokens"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ConfigError(f"{name}={v!r} must be an integer >= 0")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a power of two")
        if self.num_gpu_blocks < 2:
            raise ConfigError(
                f"num_gpu_blocks={self.num_gpu_blocks} must be >= 2 (one null block plus usable blocks)"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with enable_chunked_prefill off: "
                "longer prompts could never be scheduled"
            )
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ConfigError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be "
                f"<= max_model_len ({self.max_model_len})"
            )
        if not isinstance(self.watermark, (int, float)) or not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark={self.watermark!r} must be in [0, 1)")
        check_policy_name(self.policy)
        if self.policy_config is not None and not isinstance(self.policy_config, dict):
            raise ConfigError(f"policy_config must be a JSON object, got {self.policy_config!r}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"prefix_caching_hash_algo={self.prefix_caching_hash_algo!r} is unknown; "
                f"choose one of {', '.join(HASH_ALGOS)}"
            )
        if not isinstance(self.mamba, bool):
            raise ConfigError(f"mamba={self.mamba!r} must be true or false")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ConfigError(f"{name}={v!r} must be a positive integer or None")
        if not isinstance(self.disable_chunked_mm_input, bool):
            raise ConfigError(
                f"disable_chunked_mm_input={self.disable_chunked_mm_input!r} must be true or false"
            )
        if not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling={self.async_scheduling!r} must be true or false")
        if self.max_loras is not None and (not _is_int(self.max_loras) or self.max_loras < 1):
            raise ConfigError(f"max_loras={self.max_loras!r} must be a positive integer or None")

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept free when admitting, as vLLM counts them (null block included)."""
        return int(self.watermark * self.num_gpu_blocks)

    @property
    def encoder_budget(self) -> int:
        """Encoder embeddings computable per step."""
        v = self.max_num_encoder_input_tokens
        return self.max_num_batched_tokens if v is None else v

    @property
    def encoder_cache_embeddings(self) -> int:
        """The encoder cache's size in embeddings."""
        v = self.encoder_cache_size
        return self.max_num_batched_tokens if v is None else v

    def to_dict(self) -> dict:
        """Plain-dict form (for trace headers)."""
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every setting."""
        return [f.name for f in fields(cls)]
