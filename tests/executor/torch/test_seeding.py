"""Per-request sample seeds."""

from __future__ import annotations

from llmsched.executor.torch.seeding import sample_seed


def test_deterministic_and_distinct():
    assert sample_seed(42, 3) == sample_seed(42, 3)
    seeds = {sample_seed(s, k) for s in range(20) for k in range(50)}
    assert len(seeds) == 1000
    assert all(0 <= x < 1 << 63 for x in seeds)


def test_negative_and_huge_seeds_are_accepted():
    assert 0 <= sample_seed(-1, 0) < 1 << 63
    assert 0 <= sample_seed(1 << 80, 7) < 1 << 63
