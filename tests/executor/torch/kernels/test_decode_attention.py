"""The C decode attention kernels against the embedding_bag path: the same bits, whatever the shape."""

from __future__ import annotations

import pytest
import torch

from llmsched.executor.torch import attention, kernels
from llmsched.executor.torch.attention import DecodeGroup, PagedAttention

from ..conftest import bfloat16_outputs, prompts_of

KERNELS = kernels.decode_attention()
# Skipped only without a C compiler; a kernel that fails to compile fails these.
needs_kernels = pytest.mark.usefixtures("kernels_built")


def decode_group(lens: list[int], bs: int, num_blocks: int, g: torch.Generator) -> DecodeGroup:
    """A decode group over ``lens`` (sorted) with scattered blocks, as the input batch builds it."""
    n = len(lens)
    nb = -(-max(lens) // bs)
    table = torch.randperm(num_blocks, generator=g)[: n * nb].view(n, nb)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    visible = torch.arange(nb * bs)[None] < lens_t[:, None]
    mask = torch.zeros(visible.shape, dtype=torch.bfloat16).masked_fill_(~visible, float("-inf"))
    group = DecodeGroup(0, n, table.reshape(-1).contiguous(), mask.view(1, n, 1, nb * bs))
    group.lens = lens_t
    return group


# (head_dim, block_size, heads, KV heads): the specialised pairs (SmolLM2's
# 64/128 with groups of 3), 128-position blocks with groups of 1, 4 and 7
# (three queries at a time, then the rest), the generic loop, one query per
# KV head and the largest group.
SHAPES = [
    (64, 16, 8, 4),
    (128, 16, 8, 2),
    (64, 128, 9, 3),
    (64, 128, 4, 4),
    (128, 128, 8, 2),
    (64, 128, 14, 2),
    (128, 32, 4, 4),
    (24, 8, 6, 2),
    (16, 4, 16, 1),
]


def draw(shape: tuple[int, ...], values: str, g: torch.Generator) -> torch.Tensor:
    """Normal values, or small integers: their sums often fall exactly halfway between bfloat16s."""
    if values == "integers":
        return torch.randint(-6, 7, shape, generator=g).bfloat16()
    return torch.randn(shape, generator=g).bfloat16()


@needs_kernels
@pytest.mark.parametrize("values", ["normal", "integers"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-bs{}-h{}-kv{}".format(*s))
def test_kernels_give_the_bags_bits(shape, values):
    d, bs, nh, kvh = shape
    g = torch.Generator().manual_seed(d + bs + nh)
    attn = PagedAttention(nh, kvh, d, bs, keys_transposed=True)
    assert attn.kernels is KERNELS
    num_blocks = 200
    cache = draw((2, kvh, num_blocks, bs, d), values, g)
    # Contexts of one token, exactly a block, one past it, last blocks a
    # third and two thirds full, and longer ones.
    lens = sorted({1, bs, bs + 1, bs + bs // 3 + 1, 2 * bs + 2 * bs // 3, 3 * bs - 1, 5 * bs + 2, 7 * bs})
    group = decode_group(lens, bs, num_blocks, g)
    # Query rows strided as the projection's split leaves them.
    q = draw((len(lens), nh, 2 * d), values, g)[:, :, :d]
    fast = attn._decode_cpu(q, cache, group, None)
    slow = attn._decode_bags(q, cache, group)
    assert fast.shape == slow.shape == (len(lens), nh * d)
    assert torch.equal(fast, slow)
    # Into a slice of a step's output, and on one thread: the same bits.
    out = torch.zeros(len(lens) + 2, nh * d, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        attn._decode_cpu(q, cache, group, out[1:-1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[1:-1], slow)
    assert not out[0].any() and not out[-1].any()


@needs_kernels
def test_kernels_only_take_what_they_support():
    assert KERNELS.supports(torch.bfloat16, 8, 128)
    assert not KERNELS.supports(torch.float32, 8, 128)
    assert not KERNELS.supports(torch.float16, 8, 128)
    assert not KERNELS.supports(torch.bfloat16, KERNELS.max_group + 1, 64)
    assert not KERNELS.supports(torch.bfloat16, 1, KERNELS.max_head_dim + 1)
    # A float32 cache takes the bags even with the kernels loaded.
    attn = PagedAttention(4, 2, 8, 4, keys_transposed=True)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 2, 20, 4, 8, generator=g)
    group = decode_group([3, 9], 4, 20, g)
    group.mask = group.mask.float()
    q = torch.randn(2, 4, 8, generator=g)
    assert torch.equal(attn._decode_cpu(q, cache, group, None), attn._decode_bags(q, cache, group))


@needs_kernels
def test_bfloat16_engine_outputs_equal_with_and_without_kernels(tiny_models, monkeypatch):
    model = tiny_models["llama"]
    prompts = prompts_of([5, 19, 33, 12, 40, 7])

    with_kernels = bfloat16_outputs(model.path, prompts, 24)
    monkeypatch.setattr(attention, "decode_attention", lambda: None)
    assert bfloat16_outputs(model.path, prompts, 24) == with_kernels


@needs_kernels
@pytest.mark.parametrize("tokens", [3, 300])
def test_kv_writes_land_where_the_pytorch_writes_do(tokens):
    kvh, d, bs, num_blocks = 4, 64, 16, 64
    g = torch.Generator().manual_seed(tokens)
    cache = torch.randn(2, kvh, num_blocks, bs, d, generator=g).bfloat16()
    # k and v as views of one projection output, as the model splits them.
    kv = torch.randn(tokens, 3, kvh, d, generator=g).bfloat16()
    k, v = kv[:, 0], kv[:, 2]
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    blocks, offsets = slots // bs, slots % bs
    assert KERNELS.writes(cache, k, v)
    fast = cache.clone()
    KERNELS.write_kv(k, v, fast, blocks, offsets)
    slow = cache.clone()
    slow[0].view(kvh, -1, d, bs)[:, blocks, :, offsets] = k
    slow[1].view(kvh, -1, d).index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(fast, slow)
    assert not torch.equal(fast, cache)
    # A float32 cache is not for this kernel.
    assert not KERNELS.writes(cache.float(), k.float(), v.float())
