"""Engine arguments, named as vLLM names them, with their command-line flags.

``EngineArgs`` is the one place that knows the engine's knobs: ``LLM(...)``
takes them as keyword arguments, every command that builds an engine adds
them with ``add_cli_args`` and reads them back with ``from_cli_args``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import ConfigError
from llmsched.core.kv.block_hash import HASH_ALGOS
from llmsched.core.policy import check_policy_name
from llmsched.core.speculative import SpeculativeConfig
from llmsched.engine.batch_defaults import (
    BatchLimits,
    Platform,
    UsageContext,
    adjust_for_model_len,
    detect_platform,
    help_text,
    parse_usage_context,
    resolve_batch_limits,
)
from llmsched.engine.policy_args import add_policy_args

DTYPES = ("auto", "float32", "bfloat16", "float16")
# What async_scheduling=None resolves to: vLLM 0.33 turns it on unless an
# option rules it out (none of llmsched's does).
DEFAULT_ASYNC_SCHEDULING = True
DEVICES = ("auto", "cpu", "cuda")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?(b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from ``4096``, ``2G``, ``512MiB`` (binary) or ``1.5GB`` (decimal)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size; use bytes or a number with K, M, G or T (e.g. 2GiB)")
    number, unit, binary, suffix_b = m.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    # As in most tools: "GB" is decimal, "G" and "GiB" are binary.
    base = 1000 if suffix_b and not binary else 1024
    return int(float(number) * base**power)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(kw_only=True)
class EngineArgs:
    """Everything that builds an engine; field names are vLLM's engine argument names.

    ``model`` None means the embedded demo model (random weights).
    ``num_gpu_blocks_override`` counts the null block, as ``--num-gpu-blocks``
    does in ``llmsched simulate``. ``kv_cache_memory`` is in bytes.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # None: vLLM 0.33's default for the platform and the usage context
    # (engine/batch_defaults.py), e.g. 2048 and 128 for `serve` on CPU.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # Who builds the engine (a UsageContext value): LLM_CLASS for LLM(...)
    # and the offline benchmarks, OPENAI_API_SERVER for `serve`; None is a
    # bare engine (vLLM's ENGINE_CONTEXT).
    usage_context: str | None = None
    # None: the executor's default (128 tokens on CPU, 16 on CUDA, as vLLM).
    block_size: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    # The policy's knobs (JSON object); None: its defaults.
    policy_config: dict | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_threads: int | None = None
    # Plan each step while the previous one runs (vLLM's AsyncScheduler and
    # batch queue). None resolves as vLLM 0.33 does: on.
    async_scheduling: bool | None = None
    # Structured outputs: compact JSON (no whitespace between tokens) for
    # every JSON constraint (vLLM's structured_outputs_config.disable_any_whitespace).
    structured_outputs_disable_any_whitespace: bool = False
    # Check the scheduler's invariants after every step (slow).
    debug: bool = False
    # Load no tokenizer: prompts are token ids, outputs token ids (vLLM's skip_tokenizer_init).
    skip_tokenizer_init: bool = False
    # Speculative decoding: a dict or its JSON text, as vLLM's speculative_config
    # ({"method": "ngram", "num_speculative_tokens": 4, ...} or {"model": DIR, ...}).
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Disaggregated prefill/decode: vLLM's KVTransferConfig as JSON (or a dict).
    kv_transfer_config: str | dict | None = None
    # Serve LoRA adapters: at most max_loras of them in one step (the
    # scheduler's slot rule), each of rank at most max_lora_rank (vLLM's defaults).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # Vision-language models: most items per prompt by modality, e.g.
    # {"image": 2} (a JSON string is accepted, as on the command line).
    limit_mm_per_prompt: dict[str, int] | str | None = None

    def __post_init__(self) -> None:
        from llmsched.engine.multimodal import parse_limit_mm_per_prompt

        self.limit_mm_per_prompt = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "block_size",
            "max_model_len",
            "num_gpu_blocks_override",
            "num_threads",
        ):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ConfigError(f"{name}={v!r} must be a positive integer or None")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if not isinstance(self.enable_lora, bool):
            raise ConfigError(f"enable_lora={self.enable_lora!r} must be true or false")
        if self.kv_cache_memory is not None:
            try:
                self.kv_cache_memory = parse_size(self.kv_cache_memory)
            except ValueError as e:
                raise ConfigError(f"kv_cache_memory: {e}") from None
            if self.kv_cache_memory < 1:
                raise ConfigError(f"kv_cache_memory={self.kv_cache_memory!r} must be a positive byte count")
        if not _is_int(self.seed):
            raise ConfigError(f"seed={self.seed!r} must be an integer")
        if not _is_int(self.long_prefill_token_threshold) or self.long_prefill_token_threshold < 0:
            raise ConfigError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} must be >= 0"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device={self.device!r} is unknown; choose one of {', '.join(DEVICES)}")
        try:
            check_policy_name(self.scheduling_policy)
        except ConfigError as e:
            raise ConfigError(f"scheduling_policy={self.scheduling_policy!r}: {e}") from None
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"prefix_caching_hash_algo={self.prefix_caching_hash_algo!r} is unknown; "
                f"choose one of {', '.join(HASH_ALGOS)}"
            )
        if not isinstance(self.structured_outputs_disable_any_whitespace, bool):
            raise ConfigError("structured_outputs_disable_any_whitespace must be true or false")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling={self.async_scheduling!r} must be true, false or None")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={u!r} must be in (0, 1]")
        parse_usage_context(self.usage_context)
        if self.max_num_batched_tokens is not None and self.max_num_seqs is not None:
            self.check_batch_limits(BatchLimits(self.max_num_batched_tokens, self.max_num_seqs, False, False))

    @property
    def usage(self) -> UsageContext:
        """The usage context the batch defaults are chosen for."""
        return parse_usage_context(self.usage_context)

    def batch_limits(self, platform: Platform | None = None, max_model_len: int | None = None) -> BatchLimits:
        """``max_num_batched_tokens`` and ``max_num_seqs`` as vLLM 0.33 resolves them here, checked."""
        if platform is None:
            platform = detect_platform(self.device)
        limits = resolve_batch_limits(
            self.max_num_batched_tokens,
            self.max_num_seqs,
            usage=self.usage,
            platform=platform,
        )
        if max_model_len is not None:
            limits = adjust_for_model_len(limits, max_model_len, self.enable_chunked_prefill)
        self.check_batch_limits(limits)
        return limits

    @staticmethod
    def check_batch_limits(limits: BatchLimits) -> None:
        """Stop when a step could not hold one token per sequence, naming both values."""
        if limits.max_num_batched_tokens >= limits.max_num_seqs:
            return
        tokens = f"max_num_batched_tokens ({limits.max_num_batched_tokens}"
        tokens += ", the default here)" if limits.tokens_defaulted else ")"
        raise ConfigError(
            f"{tokens} must be >= max_num_seqs ({limits.max_num_seqs}); lower --max-num-seqs or raise "
            "--max-num-batched-tokens"
        )

    def executor_kwargs(self, platform: Platform | None = None) -> dict:
        """Keyword arguments of TorchExecutor (everything but the model path; LoRA's only when enabled)."""
        limits = self.batch_limits(platform)
        lora = {}
        if self.enable_lora:
            lora = {"enable_lora": True, "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank}
        return {
            **lora,
            "dtype": self.dtype,
            "device": self.device,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": limits.max_num_batched_tokens,
            "max_num_seqs": limits.max_num_seqs,
            "num_gpu_blocks": self.num_gpu_blocks_override,
            "kv_cache_memory": self.kv_cache_memory,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "seed": self.seed,
            "num_threads": self.num_threads,
            **({} if self.speculative_config is None else {"speculative_config": self.speculative_config}),
        }

    def create_scheduler_config(
        self,
        num_gpu_blocks: int,
        max_model_len: int,
        block_size: int | None = None,
        platform: Platform | None = None,
        max_tokens_per_mm_item: int = 0,
    ) -> SchedulerConfig:
        """The scheduler's settings, once the executor has sized the KV cache and context.

        ``block_size`` is the one the executor chose when ``self.block_size`` is None.
        A vision-language model's encoder budget and cache hold at least one
        item of ``max_tokens_per_mm_item`` embeddings, as vLLM sizes them.
        """
        bs = self.block_size or block_size
        limits = self.batch_limits(platform, max_model_len)
        mm = {}
        if max_tokens_per_mm_item:
            n = max(limits.max_num_batched_tokens, max_tokens_per_mm_item)
            mm = {"max_num_encoder_input_tokens": n, "encoder_cache_size": n}
        return SchedulerConfig(
            num_gpu_blocks=num_gpu_blocks,
            max_model_len=max_model_len,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_num_seqs=limits.max_num_seqs,
            **({} if bs is None else {"block_size": bs}),
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
            policy_config=self.policy_config,
            async_scheduling=self.resolved_async_scheduling,
            max_loras=self.max_loras if self.enable_lora else None,
            debug=self.debug,
            **self._spec_scheduler_fields(),
            **mm,
        )

    def _spec_scheduler_fields(self) -> dict[str, int]:
        spec = self.speculative_config
        if spec is None:
            return {}
        assert isinstance(spec, SpeculativeConfig)
        return {
            "num_speculative_tokens": spec.num_speculative_tokens,
            "num_lookahead_tokens": spec.num_lookahead_tokens,
        }

    @property
    def resolved_async_scheduling(self) -> bool:
        """``async_scheduling`` with None resolved as vLLM 0.33 resolves it."""
        return DEFAULT_ASYNC_SCHEDULING if self.async_scheduling is None else self.async_scheduling

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser,
        *,
        model_help: str | None = None,
        usage: UsageContext = UsageContext.LLM_CLASS,
    ) -> None:
        """Add the engine flags (``--max-num-batched-tokens`` and the rest) to ``parser``.

        ``usage`` is the entry point's usage context: it picks the batch
        defaults, which ``from_cli_args`` carries along.
        """
        g = parser.add_argument_group("engine (vLLM engine arguments)")
        g.add_argument(
            "--model",
            default=None,
            metavar="DIR",
            help=model_help
            or "Hugging Face model folder (config.json, safetensors, tokenizer); default: the embedded "
            "demo model with random weights",
        )
        g.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: --model)")
        g.add_argument(
            "--skip-tokenizer-init",
            action="store_true",
            help="load no tokenizer: prompts must be token ids and outputs are token ids only (no text, "
            "no stop strings, no chat)",
        )
        g.add_argument(
            "--dtype",
            choices=DTYPES,
            default="auto",
            help="weights and KV cache dtype (default auto: as vLLM, a float32 checkpoint runs in "
            "bfloat16 on CPUs with bf16 matmuls and Ampere+ GPUs, float16 on older GPUs; float16/bfloat16 "
            "checkpoints keep theirs, except float16 on CPU, which is not supported; the startup log says "
            "which); on CPU, bfloat16 attention runs C kernels built with the system compiler: decode "
            "with the PyTorch path's bits, prefill 3-4x faster with its own (LLMSCHED_CPU_KERNELS=0 turns "
            "them off)",
        )
        g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
        g.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")
        g.add_argument("--max-model-len", type=_positive_int, default=None)
        g.add_argument(
            "--max-num-batched-tokens",
            type=_positive_int,
            default=None,
            help="tokens per step (" + help_text("tokens", usage) + ")",
        )
        g.add_argument(
            "--max-num-seqs",
            type=_positive_int,
            default=None,
            help="sequences per step (" + help_text("seqs", usage) + ")",
        )
        parser.set_defaults(usage_context=usage.value)
        g.add_argument(
            "--block-size",
            type=_positive_int,
            default=None,
            help="KV cache block size in tokens (default: 128 on CPU, 16 on CUDA, as vLLM)",
        )
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--prefix-caching-hash-algo", choices=list(HASH_ALGOS), default="sha256")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--long-prefill-token-threshold", type=int, default=0)
        add_policy_args(g)
        g.add_argument(
            "--num-gpu-blocks-override",
            "--num-gpu-blocks",
            dest="num_gpu_blocks_override",
            type=_positive_int,
            default=None,
            help="KV cache blocks (null block included) instead of sizing from memory",
        )
        g.add_argument(
            "--kv-cache-memory",
            "--kv-cache-memory-bytes",
            dest="kv_cache_memory",
            type=_size,
            default=None,
            metavar="BYTES",
            help="KV cache size, e.g. 2GiB (the CPU default is chosen by the executor)",
        )
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        g.add_argument("--num-threads", type=_positive_int, default=None, help="torch CPU threads")
        g.add_argument(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="plan each step while the previous one runs on the model, as vLLM's AsyncScheduler "
            "(default: on, as vLLM 0.33)",
        )
        g.add_argument(
            "--structured-outputs-config.disable_any_whitespace",
            "--structured-outputs-disable-any-whitespace",
            dest="structured_outputs_disable_any_whitespace",
            action="store_true",
            help="structured outputs: JSON without whitespace between tokens (a model that favours "
            "whitespace, such as the random-weight demo model, may otherwise never close an object)",
        )
        g.add_argument(
            "--kv-transfer-config",
            default=None,
            metavar="JSON",
            help='disaggregated prefill/decode, as vLLM spells it: \'{"kv_connector": "MooncakeConnector", '
            '"kv_role": "kv_producer"|"kv_consumer"|"kv_both", "kv_ip": "127.0.0.1", "kv_port": 0}\' '
            "(kv_port: the producer's side channel, 0 = any free port); requests then carry "
            "kv_transfer_params (see llmsched proxy)",
        )

        g.add_argument(
            "--speculative-config",
            "-sc",
            dest="speculative_config",
            default=None,
            metavar="JSON",
            help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup) or '
            '\'{"model": DIR, "num_speculative_tokens": 4}\' (a draft model sharing the tokenizer)',
        )
        g.add_argument(
            "--limit-mm-per-prompt",
            default=None,
            metavar="JSON",
            help="vision-language models: most images per prompt, e.g. '{\"image\": 2}' (default: no limit)",
        )

        g = parser.add_argument_group("LoRA adapters")
        g.add_argument(
            "--enable-lora",
            action="store_true",
            help="serve PEFT LoRA adapters on the base model, chosen per request",
        )
        g.add_argument(
            "--max-loras",
            type=_positive_int,
            default=1,
            help="most distinct adapters in one step; requests of others wait (default 1, as vLLM)",
        )
        g.add_argument(
            "--max-lora-rank",
            type=_positive_int,
            default=16,
            help="largest adapter rank accepted (default 16, as vLLM)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from a namespace parsed with ``add_cli_args``'s flags."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text} must be a positive integer")
    return v


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
