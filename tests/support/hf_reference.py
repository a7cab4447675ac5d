"""What the transformers-equality tests share: random weights drawn the same way, and greedy references."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: norms around 1, everything else N(0, 0.2^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.2 * noise)


def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt of token ids."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()
