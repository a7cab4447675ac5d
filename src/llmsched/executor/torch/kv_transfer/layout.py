"""Where a block's K and V bytes lie in the paged cache, as (address, length) segments.

A layer is one [2, kv_heads, num_blocks, block_size, head_dim] allocation
(kv_cache.py), so one block is 2 * kv_heads separate runs of
block_size * head_dim elements per layer; consecutive block ids merge into
longer runs. Two instances can exchange blocks when their layouts agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmsched.executor.torch.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of an instance's cache and the base address of each layer."""

    bases: tuple[int, ...]
    num_kv_heads: int
    num_blocks: int
    block_size: int
    head_dim: int
    elem_size: int
    keys_transposed: bool
    dtype: str

    @classmethod
    def of(cls, cache: KVCache) -> KVLayout:
        """The layout of a live cache."""
        first = cache.blocks[0]
        _, kvh, nb, bs, d = first.shape
        return cls(
            tuple(t.data_ptr() for t in cache.blocks),
            kvh,
            nb,
            bs,
            d,
            first.element_size(),
            cache.keys_transposed,
            str(first.dtype),
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one (plane, head) run."""
        return self.block_size * self.head_dim * self.elem_size

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's allocation."""
        return 2 * self.num_kv_heads * self.num_blocks * self.block_bytes

    def shape_key(self) -> tuple:
        """What must match between two instances (everything but addresses and block count)."""
        return (
            len(self.bases),
            self.num_kv_heads,
            self.block_size,
            self.head_dim,
            self.keys_transposed,
            self.dtype,
        )


def transfer_lists(
    local: KVLayout, local_ids: list[int], remote: KVLayout, remote_ids: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """Local addresses, remote addresses and lengths to copy remote_ids' KV into local_ids.

    Blocks are paired one to one; runs are split where either side breaks.
    """
    pairs = _paired_runs(local_ids, remote_ids)
    bb = local.block_bytes
    lplane, rplane = local.num_blocks * bb, remote.num_blocks * bb
    dst: list[int] = []
    src: list[int] = []
    lens: list[int] = []
    for layer in range(len(local.bases)):
        lb, rb = local.bases[layer], remote.bases[layer]
        for ph in range(2 * local.num_kv_heads):
            for lstart, rstart, n in pairs:
                dst.append(lb + ph * lplane + lstart * bb)
                src.append(rb + ph * rplane + rstart * bb)
                lens.append(n * bb)
    return dst, src, lens


def _paired_runs(local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_ids, remote_ids):
        if runs:
            ls, rs, n = runs[-1]
            if ls + n == lb and rs + n == rb:
                runs[-1] = (ls, rs, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs
