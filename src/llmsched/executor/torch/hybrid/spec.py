"""A hybrid model's Mamba2 layout, parsed from config.json (Bamba's keys)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmsched.executor.torch.errors import ModelLoadError, UnsupportedModel

# Architectures whose layers mix Mamba2 mixers with full attention.
HYBRID_ARCHITECTURES = ("BambaForCausalLM",)


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """Which layers attend, and the shape of every Mamba2 mixer."""

    num_layers: int
    attn_layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    intermediate_size: int
    conv_bias: bool
    proj_bias: bool
    dt_min: float
    dt_max: float
    rotary_dim: int

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise convolution: x, then B and C of every group."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """Indices of the Mamba2 layers, ascending."""
        attn = set(self.attn_layers)
        return tuple(i for i in range(self.num_layers) if i not in attn)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one request's state over all Mamba layers (conv in ``dtype``, SSM in float32)."""
        elem = torch.empty((), dtype=dtype).element_size()
        conv = self.conv_dim * (self.conv_kernel - 1) * elem
        ssm = self.num_heads * self.head_dim * self.state_size * 4
        return len(self.mamba_layers) * (conv + ssm)

    @classmethod
    def from_bamba(cls, raw: dict, head_dim: int, where: str) -> MambaSpec:
        """Read Bamba's config.json keys (transformers' defaults where absent)."""

        def pos_int(key: str, default: int) -> int:
            v = raw.get(key, default)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelLoadError(f"{where}: {key!r} must be a positive integer, got {v!r}")
            return v

        layers = pos_int("num_hidden_layers", 32)
        hidden = pos_int("hidden_size", 4096)
        attn = raw.get("attn_layer_indices") or []
        if not isinstance(attn, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in attn):
            raise ModelLoadError(f"{where}: 'attn_layer_indices' must list layer indices below {layers}")
        heads = pos_int("mamba_n_heads", 128)
        inter = pos_int("mamba_expand", 2) * hidden
        d_head = raw.get("mamba_d_head", "auto")
        if d_head == "auto":
            d_head = inter // heads
        groups = pos_int("mamba_n_groups", 1)
        if not isinstance(d_head, int) or d_head * heads != inter or heads % groups or inter % groups:
            raise ModelLoadError(
                f"{where}: mamba_n_heads={heads} x mamba_d_head={d_head} must equal mamba_expand * "
                f"hidden_size = {inter}, and mamba_n_groups={groups} must divide the heads"
            )
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModel(
                f"{where}: hidden_act={raw.get('hidden_act')!r} is not supported (only silu)"
            )
        limit = raw.get("time_step_limit") or (0.0, float("inf"))
        lo, hi = (_as_float(v) for v in limit)
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5)))
        rotary = int(head_dim * partial)
        if rotary < 2 or rotary % 2:
            raise ModelLoadError(f"{where}: partial_rotary_factor={partial} leaves no even rotary width")
        return cls(
            num_layers=layers,
            attn_layers=tuple(sorted(set(attn))),
            num_heads=heads,
            head_dim=d_head,
            num_groups=groups,
            state_size=pos_int("mamba_d_state", 256),
            conv_kernel=pos_int("mamba_d_conv", 4),
            chunk_size=pos_int("mamba_chunk_size", 256),
            intermediate_size=inter,
            conv_bias=bool(raw.get("mamba_conv_bias", True)),
            proj_bias=bool(raw.get("mamba_proj_bias", False)),
            dt_min=lo,
            dt_max=hi,
            rotary_dim=rotary,
        )


def _as_float(v: object) -> float:
    # transformers writes infinity as {"__float__": "Infinity"}.
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)  # type: ignore[arg-type]
