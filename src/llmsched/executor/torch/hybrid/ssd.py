"""Mamba2's pieces in plain PyTorch: the causal depthwise conv with its state, the SSD scan, the gated norm.

A prefill chunk runs the chunked ("state space duality") scan: within a
chunk of ``chunk_size`` tokens the output is a masked, decay-weighted
attention-like product; chunk to chunk only the [heads, head_dim, state]
state is carried. A decode is one step of the recurrence. Both start from a
given state (zeros at position 0), so prefill chunks resume where the
previous chunk stopped. The scan works in float32, as the reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_prefill(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(causal conv) of one sequence ``x`` [L, C] after ``state`` [C, K - 1]; (out [L, C], new state)."""
    channels, width = weight.shape
    full = torch.cat([state.to(x.dtype), x.t()], dim=1)
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)[0]
    return F.silu(out.t()), full[:, full.shape[1] - (width - 1) :]


def conv_decode(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``x`` [B, C], ``state`` [B, C, K - 1]; returns (out [B, C], new state)."""
    full = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=2)
    out = (full * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out), full[:, :, 1:]


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Step sizes: softplus(dt + bias), clamped to the model's time-step limit, in float32."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(lo, hi)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan: x [L, H, P], dt [L, H], a/d [H], b/c [L, G, N], state [H, P, N] float32.

    Returns (y [L, H, P] float32, final state [H, P, N]).
    """
    length, heads, _ = x.shape
    rep = heads // b.shape[1]
    xf = x.float()
    bh = b.float().repeat_interleave(rep, dim=1)
    ch = c.float().repeat_interleave(rep, dim=1)
    xdt = xf * dt[..., None]
    da = dt * a.float()
    pad = (-length) % chunk
    if pad:
        # Zero steps at the end: no decay, no input, so the final state is unchanged.
        xdt, da, bh, ch = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (xdt, da, bh, ch))
    n = (length + pad) // chunk
    xdt = xdt.view(n, chunk, *xdt.shape[1:])
    da = da.view(n, chunk, heads)
    bh = bh.view(n, chunk, *bh.shape[1:])
    ch = ch.view(n, chunk, *ch.shape[1:])
    acs = da.cumsum(1)  # [n, l, h]
    # Within a chunk: decay from source s to target l (s <= l).
    seg = acs[:, :, None, :] - acs[:, None, :, :]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = seg.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    scores = torch.einsum("clhn,cshn->clsh", ch, bh) * decay
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)
    # Each chunk's own contribution to the state at its end.
    to_end = (acs[:, -1:, :] - acs).exp()
    chunk_states = torch.einsum("clhn,clh,clhp->chpn", bh, to_end, xdt)
    whole = acs[:, -1, :].exp()  # [n, h]
    starts = []
    s = state.float()
    for i in range(n):
        starts.append(s)
        s = s * whole[i][:, None, None] + chunk_states[i]
    y = y + torch.einsum("clhn,chpn->clhp", ch, torch.stack(starts)) * acs.exp()[..., None]
    y = y.reshape(n * chunk, heads, -1)[:length]
    return y + d.float()[:, None] * xf, s


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step per sequence: x [B, H, P], dt [B, H], b/c [B, G, N], state [B, H, P, N].

    Returns (y [B, H, P] float32, new state).
    """
    rep = x.shape[1] // b.shape[1]
    xf = x.float()
    bh = b.float().repeat_interleave(rep, dim=1)
    ch = c.float().repeat_interleave(rep, dim=1)
    decay = (dt * a.float()).exp()
    s = state.float() * decay[..., None, None] + (dt[..., None] * xf)[..., None] * bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", s, ch)
    return y + d.float()[:, None] * xf, s


def gated_rms_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """RMSNorm of y * silu(gate) over ``groups`` equal slices of the last dim, in float32, then scaled.

    The result stays float32 (weight times a float32 tensor), as in the reference; the caller casts.
    """
    h = y.float() * F.silu(gate.float())
    shape = h.shape
    g = h.view(*shape[:-1], groups, shape[-1] // groups)
    g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)
    return weight * g.view(shape)
