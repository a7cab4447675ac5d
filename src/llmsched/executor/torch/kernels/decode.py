"""The paged decode attention kernels (decode_attention.c): the embedding_bag path's bits."""

from __future__ import annotations

import ctypes
import functools

import torch

from llmsched.executor.torch.kernels.library import ARGS_I as _I
from llmsched.executor.torch.kernels.library import ARGS_L as _L
from llmsched.executor.torch.kernels.library import ARGS_P as _P
from llmsched.executor.torch.kernels.library import library


class DecodeAttentionKernels:
    """Paged decode attention's scores and output halves, and the KV cache writes, over 2-byte caches."""

    __slots__ = ("_output", "_scores", "_write", "max_group", "max_head_dim")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._scores = lib.llmsched_decode_scores
        self._scores.argtypes = [_P, _L, ctypes.c_float, _P, _L, _P, _P, _I, _I, _I, _I, _I, _I, _P, _I]
        self._scores.restype = None
        self._output = lib.llmsched_decode_output
        self._output.argtypes = [_P, _P, _L, _P, _P, _I, _I, _I, _I, _I, _I, _P, _I]
        self._output.restype = None
        self._write = lib.llmsched_write_kv
        self._write.argtypes = [_P, _L, _L, _P, _L, _L, _P, _P, _L, _P, _P, _I, _I, _I, _I, _I]
        self._write.restype = None
        group, head_dim = ctypes.c_int(), ctypes.c_int()
        lib.llmsched_decode_limits(ctypes.byref(group), ctypes.byref(head_dim))
        self.max_group, self.max_head_dim = group.value, head_dim.value

    def supports(self, dtype: torch.dtype, group: int, head_dim: int) -> bool:
        """Whether these kernels run a layer of this dtype and shape."""
        return dtype == torch.bfloat16 and group <= self.max_group and head_dim <= self.max_head_dim

    def scores(
        self,
        q: torch.Tensor,
        scale: float,
        keys: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        group: int,
        out: torch.Tensor,
    ) -> None:
        """Scaled scores [n, kv_heads, group, nb * bs] into ``out``; -inf past each request's context.

        q is [n, heads, head_dim] with contiguous rows, keys the K plane
        [kv_heads, num_blocks, head_dim, bs], table [n, nb] and lens [n] int64.
        """
        kvh, num_blocks, d, bs = keys.shape
        n, nb = table.shape
        self._scores(
            q.data_ptr(), q.stride(0), scale, keys.data_ptr(), num_blocks, table.data_ptr(), lens.data_ptr(),
            n, nb, kvh, group, d, bs, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def output(
        self,
        probs: torch.Tensor,
        values: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The probability-weighted V rows [n, kv_heads * group * head_dim] into ``out``.

        probs is [n, kv_heads, group, nb * bs], values the V plane
        [kv_heads, num_blocks, bs, head_dim].
        """
        n, kvh, group, _ = probs.shape
        _, num_blocks, bs, d = values.shape
        self._output(
            probs.data_ptr(), values.data_ptr(), num_blocks, table.data_ptr(), lens.data_ptr(),
            n, table.shape[1], kvh, group, d, bs, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    @staticmethod
    def writes(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether ``write_kv`` takes this step's k, v and this cache (a 2-byte dtype, rows contiguous)."""
        return (
            cache.element_size() == 2
            and k.dtype == v.dtype == cache.dtype
            and k.stride(-1) == 1
            and v.stride(-1) == 1
            and cache.is_contiguous()
        )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None:
        """The step's new k, v [tokens, kv_heads, head_dim] into a layer's cache at (blocks, offsets) int64.

        The cache is [2, kv_heads, num_blocks, block_size, head_dim], K blocks transposed.
        """
        n, kvh, d = k.shape
        _, _, num_blocks, bs, _ = cache.shape
        self._write(
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            cache[0].data_ptr(), cache[1].data_ptr(), num_blocks,
            blocks.data_ptr(), offsets.data_ptr(), n, kvh, d, bs, torch.get_num_threads(),
        )  # fmt: skip


@functools.cache
def decode_attention() -> DecodeAttentionKernels | None:
    """The decode attention kernels, or None when the library is off or unbuildable."""
    lib = library()
    return None if lib is None else DecodeAttentionKernels(lib)
