"""Sampled KV block residency: how long blocks live, sit idle before eviction, and wait between reuses.

The pool reports three events: a block handed out (its previous life ends,
a new one may be sampled), a block hit by a prefix-cache lookup, and a reset
of the prefix cache. Only a random sample of block lives is tracked, so the
cost stays a dictionary lookup per block. Observing never changes which
block the pool hands out.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from dataclasses import dataclass

# Accesses remembered per sampled block; the reuse gaps come from these.
MAX_ACCESSES = 4


@dataclass(slots=True, frozen=True)
class BlockEviction:
    """One sampled block life, ended by its block being handed out again (seconds)."""

    lifetime: float
    idle: float
    reuse_gaps: tuple[float, ...]


class _Life:
    __slots__ = ("accesses", "born", "last_access")

    def __init__(self, now: float) -> None:
        self.born = now
        self.last_access = now
        self.accesses: deque[float] = deque(maxlen=MAX_ACCESSES)


class BlockResidency:
    """Tracks a ``sample_rate`` fraction of block lives; ``drain()`` returns the finished ones."""

    __slots__ = ("_clock", "_lives", "_pending", "_rng", "sample_rate")

    def __init__(self, sample_rate: float, *, seed: int | None = None, clock=time.monotonic) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate={sample_rate} must be in (0, 1]")
        self.sample_rate = sample_rate
        # Its own generator: sampling must never move the sampler's random state.
        self._rng = random.Random(seed)
        self._clock = clock
        self._lives: dict[int, _Life] = {}
        self._pending: list[BlockEviction] = []

    def on_handed_out(self, block_id: int) -> None:
        """A free block was given to a request: its old life (if sampled) ends, a new one may start."""
        now = self._clock()
        life = self._lives.pop(block_id, None)
        if life is not None:
            gaps = tuple(b - a for a, b in itertools.pairwise(life.accesses))
            self._pending.append(BlockEviction(now - life.born, now - life.last_access, gaps))
        if self._rng.random() < self.sample_rate:
            self._lives[block_id] = _Life(now)

    def on_hit(self, block_id: int) -> None:
        """A prefix-cache lookup reused the block."""
        life = self._lives.get(block_id)
        if life is not None:
            now = self._clock()
            life.last_access = now
            life.accesses.append(now)

    def reset(self) -> None:
        """The prefix cache was reset: forget every tracked life."""
        self._lives.clear()
        self._pending.clear()

    def drain(self) -> list[BlockEviction]:
        """The lives that ended since the last call."""
        out, self._pending = self._pending, []
        return out

    @property
    def num_tracked(self) -> int:
        """Block lives being followed now."""
        return len(self._lives)
