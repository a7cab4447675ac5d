"""The glibc allocator settings."""

from __future__ import annotations

from llmsched.executor.torch.cpu_tuning import tune_cpu_allocator


def test_tuning_applies_once_and_reports_it():
    assert tune_cpu_allocator() is True
    assert tune_cpu_allocator() is True
