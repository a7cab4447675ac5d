"""The glibc allocator settings."""

from __future__ import annotations

import sys

import torch

from llmsched.executor.torch.cpu_tuning import tune_cpu_allocator, zeros_huge_pages


def test_tuning_applies_once_and_reports_it():
    assert tune_cpu_allocator() is True
    assert tune_cpu_allocator() is True


def test_huge_page_tensor_is_zero_aligned_and_writable():
    t = zeros_huge_pages((3, 2 << 20), torch.bfloat16)
    assert t.shape == (3, 2 << 20) and t.dtype is torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % (2 << 20) == 0
    t[1].fill_(1.5)
    assert float(t.sum()) == 1.5 * (2 << 20)


def test_small_huge_page_request_is_an_ordinary_zero_tensor():
    t = zeros_huge_pages((4, 8), torch.float32)
    assert t.shape == (4, 8) and not t.any()
