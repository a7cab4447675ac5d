"""Images in simulated workloads: how many per request, their sizes, and how often one repeats.

Each request carries ``per_request`` images. An image repeats an earlier
one (same id, so the encoder cache can share it) with probability
``repeat``; a new image's size in embeddings is drawn uniformly from
``[tokens * (1 - r), tokens * (1 + r)]``. The images sit together just
before the prompt's last token, as placeholder positions.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass

from llmsched.core.errors import ConfigError
from llmsched.core.mm_item import MMItem

# The placeholder token: below the synthetic prompts' filler ids (100+).
PLACEHOLDER = 99


@dataclass(slots=True)
class ImagePlan:
    """Per request, its images' ids; per image id, its size in embeddings."""

    ids: list[tuple[int, ...]]
    sizes: array

    def total_tokens(self, i: int) -> int:
        """Placeholder positions of request i's images."""
        sizes = self.sizes
        return sum(sizes[k] for k in self.ids[i])

    def items(self, i: int, prompt_len: int) -> tuple[MMItem, ...]:
        """Request i's encoder inputs, ending just before its last prompt token."""
        off = prompt_len - 1 - self.total_tokens(i)
        out = []
        for k in self.ids[i]:
            n = self.sizes[k]
            out.append(MMItem(off, n, f"sim-img{k}"))
            off += n
        return tuple(out)

    def place(self, i: int, tokens: list[int]) -> None:
        """Write request i's placeholders into its prompt."""
        n = self.total_tokens(i)
        if n:
            end = len(tokens) - 1
            tokens[end - n : end] = [PLACEHOLDER] * n

    def describe(self) -> str:
        """One line for reports."""
        total = sum(len(x) for x in self.ids)
        distinct = len({k for x in self.ids for k in x})
        mean = sum(self.sizes) / len(self.sizes) if len(self.sizes) else 0
        return f"{total} images ({distinct} distinct, mean {mean:.0f} embeddings)"


def plan_images(
    n: int, per_request: int, tokens: int, range_ratio: float, repeat: float, rng: random.Random
) -> ImagePlan:
    """Draw the images of ``n`` requests."""
    if per_request < 0 or tokens < 1 or not 0.0 <= range_ratio < 1.0 or not 0.0 <= repeat <= 1.0:
        raise ConfigError(
            "images: per_request must be >= 0, image tokens >= 1, range ratio in [0, 1) and repeat in [0, 1]"
        )
    lo, hi = max(1, round(tokens * (1 - range_ratio))), max(1, round(tokens * (1 + range_ratio)))
    sizes = array("l")
    ids: list[tuple[int, ...]] = []
    for _ in range(n):
        mine: list[int] = []
        for _ in range(per_request):
            if len(sizes) and rng.random() < repeat:
                k = rng.randrange(len(sizes))
            else:
                k = len(sizes)
                sizes.append(rng.randint(lo, hi))
            mine.append(k)
        ids.append(tuple(mine))
    return ImagePlan(ids, sizes)
