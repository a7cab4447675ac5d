"""The float32 C prefill attention kernel: as close to exact attention as PyTorch's float32 SDPA, and the same
bits for a query however its chunk is cut or threaded."""

from __future__ import annotations

import pytest
import torch

from llmsched.executor.torch import kernels
from llmsched.executor.torch.attention import PagedAttention
from support.prefill_attention import attend, causal_sdpa, check_paged_chunks, fused_qkv

from ..conftest import greedy, prompts_of, run_engine

KERNEL = kernels.prefill_attention_f32()


@pytest.fixture(autouse=True)
def _needs_avx2(kernels_built: None) -> None:
    """With the library built, the kernel is missing only on a CPU without AVX2 and FMA."""
    if KERNEL is None:
        pytest.skip("this CPU lacks AVX2 and FMA, which the float32 prefill kernel needs")


def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attend(KERNEL, q, k, v)


def inputs(lq: int, lk: int, heads: int, kv_heads: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    return fused_qkv(lq, lk, heads, kv_heads, d, seed, torch.float32)


SHAPES = [
    # (lq, lk, heads, kv_heads, head_dim): SmolLM2's 9 heads on 3 KV heads, tiles
    # (24 rows) cut mid-token, key blocks (256) crossed, lq < lk (cached context).
    (1, 1, 2, 1, 64),
    (5, 5, 4, 2, 16),
    (17, 17, 9, 3, 64),
    (16, 40, 4, 4, 32),
    (300, 300, 9, 3, 64),
    (100, 300, 8, 2, 128),
    (300, 700, 2, 2, 48),
    (40, 600, 16, 1, 256),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_as_close_to_exact_attention_as_pytorchs_float32_sdpa(shape):
    q, k, v = inputs(*shape, seed=sum(shape))
    exact = causal_sdpa(q.double(), k.double(), v.double())
    ours = (kernel(q, k, v).double() - exact).abs()
    torchs = (causal_sdpa(q, k, v).double() - exact).abs()
    # Both round scores, probabilities and sums to float32 in their own
    # orders: within twice PyTorch's error, on average and at worst.
    assert ours.mean() <= 2 * torchs.mean() + 1e-7
    assert ours.max() <= 2 * torchs.max() + 1e-6


def test_a_query_gets_the_same_bits_however_the_chunk_is_cut_or_threaded():
    q, k, v = inputs(600, 600, 9, 3, 64, seed=7)
    whole = kernel(q, k, v)
    # Rows 100.. as a later chunk over the same context (a prefix-cache hit or
    # chunked prefill), and as chunks of other lengths (tiles cut elsewhere).
    assert torch.equal(kernel(q[100:], k, v), whole[100:])
    assert torch.equal(kernel(q[:37], k[:37], v[:37]), whole[:37])
    assert torch.equal(kernel(q[257:531], k[:531], v[:531]), whole[257:531])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(kernel(q, k, v), whole)
    finally:
        torch.set_num_threads(threads)


def test_a_row_that_is_exactly_one_key_copies_its_value():
    q, k, v = inputs(1, 1, 4, 2, 64, seed=3)
    assert torch.equal(kernel(q, k, v), v.repeat_interleave(2, dim=1))


def test_rows_whose_head_dim_values_are_strided_are_refused():
    q, k, v = inputs(8, 8, 4, 2, 64, seed=1)
    keys = k.transpose(0, 2).contiguous().transpose(0, 2)  # the same values, head_dim strided
    with pytest.raises(
        ValueError, match=r"k must be torch\.float32 with each row's head_dim values contiguous"
    ):
        kernel(q, keys, v)
    with pytest.raises(ValueError, match=r"q must be torch\.float32"):
        kernel(q.double(), k, v)


def test_supports_float32_with_head_dims_in_16s_only():
    assert KERNEL.supports(torch.float32, 16) and KERNEL.supports(torch.float32, 64)
    assert not KERNEL.supports(torch.float32, 24) and not KERNEL.supports(torch.bfloat16, 64)
    assert not KERNEL.supports(torch.float32, KERNEL.max_head_dim + 16)
    assert PagedAttention(9, 3, 64, 16, keys_transposed=True).prefill_kernel_f32 is not None
    assert PagedAttention(4, 2, 24, 16, keys_transposed=True).prefill_kernel_f32 is None
    assert PagedAttention(4, 2, 64, 16, keys_transposed=False).prefill_kernel_f32 is None


@pytest.mark.parametrize("bs", [16, 128], ids=["blocks", "one-block-contexts"])
def test_paged_attention_runs_fresh_and_cached_float32_chunks_through_the_kernel(bs):
    """A fresh chunk, one after 40 cached tokens and another fresh one in a step: each the kernel's.

    With 128-token blocks each context fits one block, whose gathered K
    comes back as a transposed view.
    """
    check_paged_chunks(KERNEL, [(0, 23), (40, 17), (0, 30)], 9, 3, 64, bs, torch.float32, seed=5)


@pytest.mark.parametrize("threads,block_size", [(1, 4), (2, 4), (1, 128)])
def test_a_float32_engine_on_the_kernel_matches_transformers(tiny_models, monkeypatch, threads, block_size):
    """Llama's 16-wide heads run the kernel: greedy tokens equal transformers', whole prompts and chunks
    (after contexts of many blocks and of one)."""
    calls = []
    attend = kernels.PrefillAttentionKernel.attend
    monkeypatch.setattr(kernels.PrefillAttentionKernel, "attend", lambda *a: calls.append(1) or attend(*a))
    model = tiny_models["llama"]
    prompts = prompts_of([12, 12, 30, 5, 61, 9], seed=8)
    saved = torch.get_num_threads()
    try:
        run = run_engine(
            model.path,
            prompts,
            greedy(6),
            num_threads=threads,
            max_num_batched_tokens=32,
            block_size=block_size,
        )
    finally:
        torch.set_num_threads(saved)
    assert calls
    assert run.outputs == [model.greedy(p, 6) for p in prompts]
