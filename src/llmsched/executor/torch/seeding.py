"""Per-request random streams keyed by (seed, output position).

A seeded request draws its noise for output token k from a generator seeded
with mix(seed, k) alone, so what it samples depends neither on which other
requests share the batch nor on preemption and recomputation.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One splitmix64 step: a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, output_index: int) -> int:
    """The generator seed for output token ``output_index`` of a request seeded with ``seed``."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ output_index) & ((1 << 63) - 1)
