"""vLLM 0.33's default batch limits, by platform and entry point.

When the user leaves ``max_num_batched_tokens`` or ``max_num_seqs`` unset,
vLLM picks them from the device (CPU; CUDA cards by total memory and name)
and from the entry point that builds the engine (the ``LLM`` class and the
offline benchmarks, ``vllm serve``, or a bare engine). This module holds that
table and the adjustments vLLM makes after it, so every llmsched entry point
and the simulator resolve the same numbers vLLM would. Pure standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from llmsched.core.errors import ConfigError
from llmsched.executor.platform import Platform

GiB = 1 << 30


class UsageContext(str, Enum):
    """Who builds the engine (vLLM's names); the defaults depend on it."""

    LLM_CLASS = "LLM_CLASS"  # LLM(...), offline benchmarks, generate/chat
    OPENAI_API_SERVER = "OPENAI_API_SERVER"  # `serve`
    ENGINE_CONTEXT = "ENGINE_CONTEXT"  # an engine built directly


def parse_usage_context(name: str | None) -> UsageContext:
    """The UsageContext named ``name`` (None: a bare engine's); a ConfigError names the choices."""
    if name is None:
        return UsageContext.ENGINE_CONTEXT
    if name not in UsageContext.__members__:
        choices = ", ".join(UsageContext.__members__)
        raise ConfigError(f"usage_context={name!r} is unknown; choose one of {choices}")
    return UsageContext(name)


# Command-line entry points and the usage context vLLM gives each
# (`vllm bench throughput` and `latency` build an LLM).
ENTRY_POINTS: dict[str, UsageContext] = {
    "llm": UsageContext.LLM_CLASS,
    "serve": UsageContext.OPENAI_API_SERVER,
    "bench": UsageContext.LLM_CLASS,
    "engine": UsageContext.ENGINE_CONTEXT,
}

# vLLM's SchedulerConfig defaults: what a context missing from the table gets.
FALLBACK_MAX_NUM_BATCHED_TOKENS = 2048
FALLBACK_MAX_NUM_SEQS = 128


def device_class(platform: Platform) -> str:
    """The row of vLLM's table a platform falls in."""
    if platform.kind == "cpu":
        return "cpu"
    if platform.total_memory >= 160 * GiB:
        return "gpu>=160GiB"
    # A100 is excluded by name: large budgets cost it throughput (vLLM PR 17885).
    if (
        platform.total_memory >= 70 * GiB
        and "a100" not in platform.device_name.lower()
        and not platform.is_gb10
    ):
        return "gpu-h100-class"
    return "gpu-other"


# (max_num_batched_tokens, max_num_seqs) per device class and usage context;
# the CPU row is per rank of the world size.
_TABLE: dict[str, dict[UsageContext, tuple[int, int]]] = {
    "cpu": {UsageContext.LLM_CLASS: (4096, 256), UsageContext.OPENAI_API_SERVER: (2048, 128)},
    "gpu>=160GiB": {UsageContext.LLM_CLASS: (16384, 1024), UsageContext.OPENAI_API_SERVER: (16384, 1024)},
    "gpu-h100-class": {UsageContext.LLM_CLASS: (16384, 1024), UsageContext.OPENAI_API_SERVER: (8192, 1024)},
    "gpu-other": {UsageContext.LLM_CLASS: (8192, 256), UsageContext.OPENAI_API_SERVER: (2048, 256)},
}


def table_defaults(platform: Platform, usage: UsageContext) -> tuple[int, int]:
    """vLLM's table entry (tokens, seqs) before the adjustments for the model."""
    row = _TABLE[device_class(platform)]
    tokens, seqs = row.get(usage, (FALLBACK_MAX_NUM_BATCHED_TOKENS, FALLBACK_MAX_NUM_SEQS))
    if platform.kind == "cpu" and usage in row:
        tokens, seqs = tokens * platform.world_size, seqs * platform.world_size
    return tokens, seqs


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The limits in force and whether each came from the defaults."""

    max_num_batched_tokens: int
    max_num_seqs: int
    tokens_defaulted: bool
    seqs_defaulted: bool

    def log_lines(self, usage: UsageContext, platform: Platform) -> list[str]:
        """What vLLM logs about them (its debug lines, shown here at info level)."""
        ctx, where = usage.value, platform.describe()
        lines = []
        if self.tokens_defaulted:
            lines.append(
                f"Defaulting max_num_batched_tokens to {self.max_num_batched_tokens} for {ctx} usage "
                f"context on {where}."
            )
        if self.seqs_defaulted:
            lines.append(
                f"Defaulting max_num_seqs to {self.max_num_seqs} for {ctx} usage context on {where}."
            )
        return lines


def resolve_batch_limits(
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None,
    *,
    usage: UsageContext,
    platform: Platform,
    max_model_len: int | None = None,
    enable_chunked_prefill: bool = True,
) -> BatchLimits:
    """The limits vLLM 0.33 uses: the user's where set, else the table, adjusted as vLLM does.

    ``max_model_len`` None skips the adjustments that need it (callers that
    know it only later apply ``adjust_for_model_len``).
    """
    d_tokens, d_seqs = table_defaults(platform, usage)
    tokens = d_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    seqs = d_seqs if max_num_seqs is None else max_num_seqs
    if max_num_seqs is None:
        # vLLM's last step, taken now too so a small user budget passes the check;
        # adjust_for_model_len takes it again once the budget is final.
        seqs = min(seqs, tokens)
    limits = BatchLimits(tokens, seqs, max_num_batched_tokens is None, max_num_seqs is None)
    if max_model_len is None:
        return limits
    return adjust_for_model_len(limits, max_model_len, enable_chunked_prefill)


def adjust_for_model_len(
    limits: BatchLimits, max_model_len: int, enable_chunked_prefill: bool
) -> BatchLimits:
    """vLLM's fixes to defaulted limits once the context length is known.

    A defaulted budget grows to ``max_model_len`` when chunked prefill is off
    (a whole prompt must fit one step) and never exceeds ``max_num_seqs x
    max_model_len``; a defaulted ``max_num_seqs`` never exceeds the budget.
    Limits the user set are left alone (and checked by the scheduler config).
    """
    tokens, seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    if limits.tokens_defaulted:
        if not enable_chunked_prefill:
            tokens = max(max_model_len, tokens)
        tokens = min(seqs * max_model_len, tokens)
    if limits.seqs_defaulted:
        seqs = min(seqs, tokens)
    return BatchLimits(tokens, seqs, limits.tokens_defaulted, limits.seqs_defaulted)


def detect_platform(device: str = "auto", world_size: int = 1) -> Platform:
    """The platform an engine on ``device`` ("auto", "cpu", "cuda", "cuda:N") runs on."""
    if device == "cpu":
        return Platform("cpu", world_size=world_size)
    import torch

    if not torch.cuda.is_available():
        # "cuda" without CUDA fails later, where the executor names the problem.
        return Platform("cpu", world_size=world_size)
    index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return Platform(
        "cuda",
        device_name=props.name,
        total_memory=props.total_memory,
        is_gb10=(props.major, props.minor) == (12, 1),
        world_size=world_size,
    )


def help_text(flag: str, usage: UsageContext) -> str:
    """``--help`` text saying what the default of ``flag`` resolves to for this entry point."""
    idx = 0 if flag == "tokens" else 1
    parts = []
    for label, platform in (
        ("CPU", Platform("cpu")),
        ("GPUs of 160 GiB or more", Platform("cuda", "b200", 180 * GiB)),
        ("H100/H200-class GPUs (70 GiB or more, not A100)", Platform("cuda", "h100", 80 * GiB)),
        ("other GPUs, A100 included", Platform("cuda", "a100", 80 * GiB)),
    ):
        parts.append(f"{table_defaults(platform, usage)[idx]} on {label}")
    return (
        f"default: as vLLM 0.33 for {usage.value}: " + ", ".join(parts) + "; the startup log shows the value"
    )
