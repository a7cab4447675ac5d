"""The decoder's elementwise pieces: RMSNorm and the SwiGLU activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dim in float32, cast back, then scale (the reference rounding order)."""
    xf = x.float()
    var = xf.square().mean(-1, keepdim=True)
    var.add_(eps).rsqrt_()
    xf = xf * var if xf is x else xf.mul_(var)
    return weight * xf.to(x.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused [tokens, 2 * intermediate] projection."""
    half = gate_up.shape[-1] // 2
    out = F.silu(gate_up[..., :half])
    return out.mul_(gate_up[..., half:])
