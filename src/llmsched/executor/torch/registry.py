"""The architectures this executor implements, keyed by config.json's ``architectures`` name.

Llama, Mistral, Qwen2 and Qwen3 are the same decoder (RMSNorm, RoPE,
grouped-query attention, SwiGLU); they differ only in which attention
projections carry a bias and whether q and k are RMS-normalised per head.
Bamba, a hybrid, has its own forward (executor/torch/hybrid) whose attention
layers follow the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmsched.executor.torch.errors import UnsupportedModel


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """How one Hugging Face architecture maps onto the shared decoder."""

    name: str
    # True/False fixes the q/k/v bias; None reads config.json's attention_bias
    # (which for Llama-style models also puts a bias on o_proj).
    qkv_bias: bool | None
    qk_norm: bool


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("LlamaForCausalLM", qkv_bias=None, qk_norm=False),
        ArchSpec("MistralForCausalLM", qkv_bias=None, qk_norm=False),
        ArchSpec("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
        ArchSpec("Qwen3ForCausalLM", qkv_bias=None, qk_norm=True),
        # Hybrid: Mamba2 layers beside Llama-like attention (see executor/torch/hybrid).
        ArchSpec("BambaForCausalLM", qkv_bias=None, qk_norm=False),
    )
}


def supported_architectures() -> list[str]:
    """Names accepted in config.json's ``architectures``."""
    return sorted(ARCHITECTURES)


def lookup(architectures: list[str], where: str) -> ArchSpec:
    """The spec for the first supported name, or UnsupportedModel listing what is supported."""
    for name in architectures:
        spec = ARCHITECTURES.get(name)
        if spec is not None:
            return spec
    raise UnsupportedModel(
        f"{where}: architecture {', '.join(architectures) or '(none given)'} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )
