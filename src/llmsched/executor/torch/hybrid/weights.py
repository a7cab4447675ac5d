"""Loading a Bamba folder's safetensors: Mamba2 mixers, attention layers, MLPs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.errors import WeightsMismatch
from llmsched.executor.torch.weights import open_all_tensors


@dataclass(slots=True)
class MixerWeights:
    """One Mamba2 mixer: in/out projections, depthwise conv [C, K], dt bias, A (< 0, float32), D, norm."""

    in_proj: torch.Tensor
    in_bias: torch.Tensor | None
    conv: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    a: torch.Tensor
    d: torch.Tensor
    norm: torch.Tensor
    out_proj: torch.Tensor
    out_bias: torch.Tensor | None


@dataclass(slots=True)
class AttnWeights:
    """One attention layer: fused q/k/v and the output projection."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None


@dataclass(slots=True)
class HybridLayer:
    """A layer: its norms, its MLP, and either a mixer or attention."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    mixer: MixerWeights | None
    attn: AttnWeights | None


@dataclass(slots=True)
class HybridWeights:
    """All of a hybrid model's tensors on the target device and dtype."""

    embed: torch.Tensor
    layers: list[HybridLayer]
    norm: torch.Tensor
    lm_head: torch.Tensor


def load_hybrid_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> HybridWeights:
    """Read and check a Bamba folder's tensors; q/k/v and gate/up are fused."""
    spec = config.hybrid
    assert spec is not None, "not a hybrid model"
    shapes, read = open_all_tensors(config)

    def get(name: str, present: bool = True) -> torch.Tensor | None:
        if not present:
            return None
        if name not in shapes:
            raise WeightsMismatch(
                f"{str(config.path)!r}: the weights lack {name!r}, which a Bamba model needs"
            )
        return read(name).to(dtype).to(device).contiguous()

    def cat(names: list[str], present: bool = True) -> torch.Tensor | None:
        return torch.cat([get(n) for n in names]) if present else None  # type: ignore[misc]

    attn = set(spec.attn_layers)
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        f = p + "feed_forward."
        mb = config.mlp_bias
        layers.append(
            HybridLayer(
                input_norm=get(p + "input_layernorm.weight"),  # type: ignore[arg-type]
                post_norm=get(p + "pre_ff_layernorm.weight"),  # type: ignore[arg-type]
                gate_up=cat([f + "gate_proj.weight", f + "up_proj.weight"]),  # type: ignore[arg-type]
                gate_up_bias=cat([f + "gate_proj.bias", f + "up_proj.bias"], mb),
                down=get(f + "down_proj.weight"),  # type: ignore[arg-type]
                down_bias=get(f + "down_proj.bias", mb),
                mixer=None if i in attn else _mixer(p + "mamba.", get, config),
                attn=_attention(p + "self_attn.", get, cat, config) if i in attn else None,
            )
        )
    embed = get("model.embed_tokens.weight")
    assert embed is not None
    head = embed if config.tie_word_embeddings else get("lm_head.weight")
    norm = get("model.final_layernorm.weight")
    return HybridWeights(embed=embed, layers=layers, norm=norm, lm_head=head)  # type: ignore[arg-type]


def _mixer(m: str, get: Callable[..., torch.Tensor | None], config: ModelConfig) -> MixerWeights:
    spec = config.hybrid
    assert spec is not None
    conv = get(m + "conv1d.weight")
    assert conv is not None
    expect = (spec.conv_dim, 1, spec.conv_kernel)
    if tuple(conv.shape) != expect:
        raise WeightsMismatch(
            f"{str(config.path)!r}: {m}conv1d.weight is {tuple(conv.shape)}, expected {expect}"
        )
    a_log = get(m + "A_log")
    assert a_log is not None
    return MixerWeights(
        in_proj=get(m + "in_proj.weight"),  # type: ignore[arg-type]
        in_bias=get(m + "in_proj.bias", spec.proj_bias),
        conv=conv[:, 0].contiguous(),
        conv_bias=get(m + "conv1d.bias", spec.conv_bias),
        dt_bias=get(m + "dt_bias"),  # type: ignore[arg-type]
        a=-torch.exp(a_log.float()),
        d=get(m + "D"),  # type: ignore[arg-type]
        norm=get(m + "norm.weight"),  # type: ignore[arg-type]
        out_proj=get(m + "out_proj.weight"),  # type: ignore[arg-type]
        out_bias=get(m + "out_proj.bias", spec.proj_bias),
    )


def _attention(
    a: str,
    get: Callable[..., torch.Tensor | None],
    cat: Callable[..., torch.Tensor | None],
    config: ModelConfig,
) -> AttnWeights:
    return AttnWeights(
        qkv=cat([a + f"{n}_proj.weight" for n in "qkv"]),  # type: ignore[arg-type]
        qkv_bias=cat([a + f"{n}_proj.bias" for n in "qkv"], config.qkv_bias),
        o_proj=get(a + "o_proj.weight"),  # type: ignore[arg-type]
        o_bias=get(a + "o_proj.bias", config.o_bias),
    )
