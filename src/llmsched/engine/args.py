"""Engine arguments, named as vLLM names them, with their command-line flags.

``EngineArgs`` is the one place that knows the engine's knobs: ``LLM(...)``
takes them as keyword arguments, every command that builds an engine adds
them with ``add_cli_args`` and reads them back with ``from_cli_args``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from pathlib import Path

from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import ConfigError
from llmsched.core.json_object import parse_json_object
from llmsched.core.kv.block_hash import HASH_ALGOS
from llmsched.core.policy import check_policy_name
from llmsched.core.speculative import SpeculativeConfig
from llmsched.engine.arg_types import positive_int
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
# vLLM's other spellings of the same dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# vLLM's hash algorithm names: xxhash is xxh3_128; the _cbor variants serialise a block's
# fields differently before hashing, which changes no hit or miss (llmsched publishes no hashes).
HASH_ALGO_ALIASES = {"xxhash": "xxh3_128", "sha256_cbor": "sha256", "xxhash_cbor": "xxh3_128"}
# generation_config values that are not a folder: the model's own file, or none at all.
GENERATION_CONFIG_MODES = ("auto", "vllm")
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
    # Where the default sampling parameters come from, as vLLM: "auto" the model's
    # generation_config.json, "vllm" none (SamplingParams' own), or a folder holding one.
    generation_config: str = "auto"
    # Sampling defaults laid over those (a dict or its JSON text), as vLLM's override_generation_config.
    override_generation_config: dict | str | None = None
    # Admission keeps room for the whole prompt (vLLM 0.33's default), and a fraction of
    # the KV blocks free; a chunk of multimodal input is never split across steps when set.
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    disable_chunked_mm_input: bool = False

    def __post_init__(self) -> None:
        from llmsched.engine.multimodal import parse_limit_mm_per_prompt

        self.limit_mm_per_prompt = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        algo = self.prefix_caching_hash_algo
        self.prefix_caching_hash_algo = HASH_ALGO_ALIASES.get(algo, algo)
        # vLLM's EngineArgs leaves these None to mean its default.
        for name, default in (
            ("enable_prefix_caching", True),
            ("enable_chunked_prefill", True),
            ("enable_lora", False),
        ):
            if getattr(self, name) is None:
                setattr(self, name, default)
        self._check_vllm_extras()
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

    def _check_vllm_extras(self) -> None:
        """Check the generation-config and admission fields vLLM's names brought in."""
        gc = self.generation_config
        if not isinstance(gc, str) or (gc not in GENERATION_CONFIG_MODES and not Path(gc).is_dir()):
            raise ConfigError(
                f"generation_config={gc!r} must be 'auto' (the model's generation_config.json), 'vllm' "
                "(no model defaults) or a folder holding a generation_config.json"
            )
        over = self.override_generation_config
        if over is not None:
            self.override_generation_config = parse_json_object(over, "override_generation_config")
        w = self.watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < 1.0:
            raise ConfigError(f"watermark={w!r} must be in [0, 1)")
        for name in ("scheduler_reserve_full_isl", "disable_chunked_mm_input"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")

    def generation_defaults(self, model_defaults: dict) -> dict:
        """The default sampling parameters: ``model_defaults`` (the model's) or none or a folder's."""
        from llmsched.engine.model_files import ModelFiles, read_json

        if self.generation_config == "auto":
            defaults = dict(model_defaults)
        elif self.generation_config == "vllm":
            defaults = {}
        else:
            path = Path(self.generation_config)
            files = ModelFiles(path=path, generation_config=read_json(path / "generation_config.json"))
            defaults = files.generation_defaults
        return {**defaults, **(self.override_generation_config or {})}

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
            scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
            watermark=self.watermark,
            disable_chunked_mm_input=self.disable_chunked_mm_input,
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
        _negative(g, "--no-skip-tokenizer-init", "skip_tokenizer_init")
        g.add_argument(
            "--dtype",
            choices=(*DTYPES, *DTYPE_ALIASES),
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
        g.add_argument(
            "--max-model-len",
            type=_model_len,
            default=None,
            help="longest prompt + output in tokens, e.g. 4096 or 4k (default or auto: the model's)",
        )
        g.add_argument(
            "--max-num-batched-tokens",
            type=_human_int,
            default=None,
            help="tokens per step (" + help_text("tokens", usage) + ")",
        )
        g.add_argument(
            "--max-num-seqs",
            type=positive_int,
            default=None,
            help="sequences per step (" + help_text("seqs", usage) + ")",
        )
        parser.set_defaults(usage_context=usage.value)
        g.add_argument(
            "--block-size",
            type=positive_int,
            default=None,
            help="KV cache block size in tokens (default: 128 on CPU, 16 on CUDA, as vLLM)",
        )
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        _negative(g, "--disable-prefix-caching", "enable_prefix_caching")
        g.add_argument(
            "--prefix-caching-hash-algo",
            choices=(*HASH_ALGOS, *HASH_ALGO_ALIASES),
            default="sha256",
            help="block hash function (default sha256); vLLM's xxhash is xxh3_128, and its _cbor "
            "variants hash with the same function",
        )
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        _negative(g, "--disable-chunked-prefill", "enable_chunked_prefill")
        g.add_argument("--long-prefill-token-threshold", type=int, default=0)
        g.add_argument(
            "--scheduler-reserve-full-isl",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="admit a request only when its whole prompt fits in free KV blocks (default on, as vLLM)",
        )
        g.add_argument(
            "--watermark",
            type=float,
            default=0.0,
            metavar="FRACTION",
            help="fraction of KV blocks admission keeps free (default 0, as vLLM)",
        )
        g.add_argument(
            "--disable-chunked-mm-input",
            action="store_true",
            help="never split an image's placeholder tokens across steps",
        )
        _negative(g, "--enable-chunked-mm-input", "disable_chunked_mm_input")
        g.add_argument(
            "--generation-config",
            default="auto",
            metavar="auto|vllm|DIR",
            help="default sampling parameters: auto, the model's generation_config.json (default); vllm, "
            "none; or a folder holding a generation_config.json",
        )
        g.add_argument(
            "--override-generation-config",
            default=None,
            metavar="JSON",
            help="sampling defaults laid over --generation-config's, e.g. '{\"temperature\": 0.5}'",
        )
        add_policy_args(g)
        g.add_argument(
            "--num-gpu-blocks-override",
            "--num-gpu-blocks",
            dest="num_gpu_blocks_override",
            type=positive_int,
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
        g.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float, default=0.9)
        g.add_argument("--num-threads", type=positive_int, default=None, help="torch CPU threads")
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
        _negative(g, "--disable-lora", "enable_lora")
        g.add_argument(
            "--max-loras",
            type=positive_int,
            default=1,
            help="most distinct adapters in one step; requests of others wait (default 1, as vLLM)",
        )
        g.add_argument(
            "--max-lora-rank",
            type=positive_int,
            default=16,
            help="largest adapter rank accepted (default 16, as vLLM)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from a namespace parsed with ``add_cli_args``'s flags."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _negative(group: argparse._ArgumentGroup, option: str, dest: str) -> None:
    """vLLM's spelling of the off form of a boolean flag (--disable-X for --enable-X)."""
    group.add_argument(option, dest=dest, action="store_false", help=argparse.SUPPRESS)


_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgGtT]?)$")


def _human_int(text: str) -> int:
    """A positive count as vLLM writes it: 2048, 4k (4000) or 4K (4096), 1.5M."""
    m = _HUMAN_INT.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (e.g. 2048, 4k = 4000, 4K = 4096)")
    number, unit = m.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    value = float(number) * (1024 if unit.isupper() else 1000) ** power
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be a positive whole number of tokens")
    return int(value)


def _model_len(text: str) -> int | None:
    """--max-model-len: a count, or auto / -1 for the model's own (vLLM's spellings)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return _human_int(text)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
