"""The C prefill attention kernel: as close to float32 attention as PyTorch's bfloat16 SDPA, and the same bits
for a query however its chunk is cut or threaded."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from llmsched.executor.torch import kernels
from llmsched.executor.torch.attention import PagedAttention
from support.hf_reference import randomize
from support.prefill_attention import attend, causal_sdpa, check_paged_chunks, fused_qkv

from ..conftest import COMMON, TinyModel, bfloat16_outputs, prompts_of

KERNEL = kernels.prefill_attention()


@pytest.fixture(autouse=True)
def _needs_avx512_bf16(kernels_built: None) -> None:
    """With the library built, the kernel is missing only on a CPU without AVX-512 BF16."""
    if KERNEL is None:
        pytest.skip("this CPU lacks AVX-512 BF16, which the prefill kernel needs")


def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attend(KERNEL, q, k, v)


def inputs(lq: int, lk: int, heads: int, kv_heads: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    return fused_qkv(lq, lk, heads, kv_heads, d, seed, torch.bfloat16)


SHAPES = [
    # (lq, lk, heads, kv_heads, head_dim)
    (1, 1, 2, 1, 64),
    (5, 5, 4, 2, 64),
    (17, 17, 8, 4, 64),
    (16, 40, 4, 4, 64),
    (100, 300, 8, 2, 64),
    (257, 257, 4, 1, 128),
    (300, 700, 2, 2, 128),
    (40, 600, 16, 1, 256),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_as_close_to_float32_as_pytorchs_bfloat16_attention(shape):
    q, k, v = inputs(*shape, seed=sum(shape))
    exact = causal_sdpa(q.float(), k.float(), v.float())
    ours = (kernel(q, k, v).float() - exact).abs()
    torchs = (causal_sdpa(q, k, v).float() - exact).abs()
    # Both round the output to bfloat16 (2^-9 relative) and the
    # probabilities too: within twice PyTorch's error, on average and at worst.
    assert ours.mean() <= 2 * torchs.mean() + 1e-6
    assert ours.max() <= 2 * torchs.max() + 1e-6


def test_a_query_gets_the_same_bits_however_the_chunk_is_cut_or_threaded():
    q, k, v = inputs(300, 300, 8, 4, 64, seed=7)
    whole = kernel(q, k, v)
    # Rows 100.. as a later chunk over the same context (a prefix-cache hit or
    # chunked prefill), and as chunks of other lengths.
    assert torch.equal(kernel(q[100:], k, v), whole[100:])
    assert torch.equal(kernel(q[:37], k[:37], v[:37]), whole[:37])
    assert torch.equal(kernel(q[257:280], k[:280], v[:280]), whole[257:280])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernel(q, k, v), whole)
    finally:
        torch.set_num_threads(threads)


def test_a_row_that_is_exactly_one_key_copies_its_value():
    q, k, v = inputs(1, 1, 4, 2, 64, seed=3)
    assert torch.equal(kernel(q, k, v), v.repeat_interleave(2, dim=1))


def test_supports_bfloat16_with_head_dims_in_64s_only():
    assert KERNEL.supports(torch.bfloat16, 64) and KERNEL.supports(torch.bfloat16, 128)
    assert not KERNEL.supports(torch.bfloat16, 96) and not KERNEL.supports(torch.float32, 64)
    assert not KERNEL.supports(torch.bfloat16, KERNEL.max_head_dim + 64)
    assert PagedAttention(4, 2, 64, 16, keys_transposed=True).prefill_kernel is not None
    assert PagedAttention(4, 2, 32, 16, keys_transposed=True).prefill_kernel is None
    assert PagedAttention(4, 2, 64, 16, keys_transposed=False).prefill_kernel is None


@pytest.mark.parametrize("chunks", [[(0, 23)], [(0, 23), (0, 9), (40, 17)]], ids=["fresh", "mixed"])
def test_paged_attention_runs_fresh_and_cached_chunks_through_the_kernel(chunks):
    """A layer's output for (context start, length) chunks: the kernel over each chunk's whole context."""
    check_paged_chunks(KERNEL, chunks, 4, 2, 64, 16, torch.bfloat16, seed=len(chunks))


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny random Qwen3 with 64-wide heads, so that its bfloat16 prefill runs the kernel."""
    torch.manual_seed(11)
    hf = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=64)).eval()
    randomize(hf, 11)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    path = tmp_path_factory.mktemp("wide_heads")
    hf.save_pretrained(path)
    return TinyModel("qwen3", path, hf)


def bfloat16_run(model: TinyModel, prompts: list[list[int]], max_tokens: int, budget: int) -> list[list[int]]:
    return bfloat16_outputs(
        model.path, prompts, max_tokens, block_size=16, max_model_len=128, max_num_batched_tokens=budget
    )


def test_a_bfloat16_engine_on_the_kernel_agrees_with_float32_transformers(wide_heads, monkeypatch):
    calls = []
    attend = kernels.PrefillAttentionKernel.attend
    monkeypatch.setattr(kernels.PrefillAttentionKernel, "attend", lambda *a: calls.append(1) or attend(*a))
    prompts = prompts_of([7, 19, 30, 12, 25, 4, 16, 9], seed=13)
    outputs = bfloat16_run(wide_heads, prompts, 4, budget=256)
    assert calls
    agree = sum(o[0] == wide_heads.greedy(p, 4)[0] for o, p in zip(outputs, prompts))
    assert agree >= 6


def test_chunked_prefill_and_prefix_hits_give_the_whole_prompts_tokens(wide_heads):
    """Each query's attention bits do not depend on where its chunk starts."""
    shared = prompts_of([40], seed=3)[0]
    prompts = [shared + tail for tail in prompts_of([3, 21, 9, 30], seed=4)]
    whole = bfloat16_run(wide_heads, prompts, 6, budget=512)
    assert bfloat16_run(wide_heads, prompts, 6, budget=24) == whole


def test_no_memory_for_the_packed_keys_is_a_memory_error_not_a_crash():
    """In a child whose address space is capped: a context too long to repack raises MemoryError."""
    code = (
        "import resource, torch\n"
        "from llmsched.executor.torch import kernels\n"
        "k = kernels.prefill_attention()\n"
        "keys = 1 << 22\n"
        "row = torch.zeros(1, 8, 64, dtype=torch.bfloat16).expand(keys, 8, 64)  # 4 GiB once packed\n"
        "q = torch.zeros(1, 8, 64, dtype=torch.bfloat16)\n"
        "used = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    k.attend(q, row, row, 0.125, torch.empty_like(q))\n"
        "except MemoryError as e:\n"
        "    print('raised:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised: prefill attention: no memory to repack 4194304 keys" in done.stdout
