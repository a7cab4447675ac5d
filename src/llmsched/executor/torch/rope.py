"""Rotary position embeddings: frequencies (plain, linear, Llama-3 scaled) and their application.

Frequencies and angles are computed in float32 the way the reference
implementation does, then cast to the model dtype, so float32 runs match it
bit for bit. The rotation is the "rotate half" form (first half of each head
paired with the second half).
"""

from __future__ import annotations

import math

import torch

from llmsched.executor.torch.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """One float32 frequency per rotated pair: [head_dim // 2]."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    kind = scaling["rope_type"]
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    return inv


def _llama3(inv: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's rescaling: long wavelengths slowed by ``factor``, short kept, a blend between."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv
    slowed = torch.where(wavelength > context / low, inv / factor, inv)
    # Between the two cut-offs the frequency moves linearly (in context / wavelength)
    # from the slowed value to the original one.
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    middle = ~(wavelength < context / high) & ~(wavelength > context / low)
    return torch.where(middle, blended, slowed)


class RotaryEmbedding:
    """Cos/sin tables for every position below ``max_positions``, in the model dtype."""

    __slots__ = ("cos", "cos_full", "half", "sin", "sin_signed")

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device):
        inv = inverse_frequencies(config)
        angles = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)[:, None] * inv[None, :]
        self.cos = angles.cos().to(dtype).to(device)
        self.sin = angles.sin().to(dtype).to(device)
        self.half = config.head_dim // 2
        # Full-width tables for ``rotate``: cos repeated, sin negated on the
        # first half (negation is exact, so x1 * -sin == -(x1 * sin) bit for bit).
        self.cos_full = torch.cat((self.cos, self.cos), -1)
        self.sin_signed = torch.cat((-self.sin, self.sin), -1)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for a step's positions, shaped [tokens, 1, head_dim // 2] to broadcast over heads."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(
            0, positions
        ).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [tokens, heads, head_dim] (a view is fine); returns a new tensor."""
        half = self.half
        x1 = x[..., :half]
        x2 = x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1 = out[..., :half]
        o2 = out[..., half:]
        # Same rounding steps as x * cos + rotate_half(x) * sin.
        torch.mul(x1, cos, out=o1)
        o1.sub_(x2 * sin)
        torch.mul(x2, cos, out=o2)
        o2.add_(x1 * sin)
        return out

    def lookup_full(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) full-width tables for ``rotate``: [tokens, 1, head_dim]."""
        return self.cos_full.index_select(0, positions).unsqueeze(1), self.sin_signed.index_select(
            0, positions
        ).unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``apply`` in four full-width ops instead of seven half-width ones; the same bits.

        Each half gets x * cos plus the other half times the (signed) sin,
        rounded after each op as ``apply`` does: (x1 * cos) + (x2 * -sin)
        equals (x1 * cos) - (x2 * sin) exactly. Fewer, larger ops suit small
        (decode) steps, where per-op overhead dominates; ``apply`` moves
        fewer bytes, which suits prefill-sized steps.
        """
        half = self.half
        out = x * cos_full
        swapped = torch.cat((x[..., half:], x[..., :half]), -1)
        return out.add_(swapped.mul_(sin_signed))
