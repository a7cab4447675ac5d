"""C kernels for the CPU path, loaded with ctypes, each with a PyTorch path to fall back on.

``decode_attention()`` returns the paged decode attention kernels (see
decode_attention.c), which give the embedding_bag path's bits.
``prefill_attention()`` returns the causal prefill attention kernel (see
prefill_attention.c), which runs bfloat16 chunks 3-4x faster than PyTorch's
SDPA with bits of its own. ``elementwise()`` returns the bfloat16 RMSNorm
(alone or after the residual add) in one pass with PyTorch's bits (see
elementwise.c). All are None when the kernels are switched off
(``LLMSCHED_CPU_KERNELS=0``) or cannot be built here, in which case the
reason is logged once and the PyTorch paths run; the prefill kernel also
needs a CPU with AVX-512 BF16; the RMSNorm checks on load that its sums
have this PyTorch's bits.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from llmsched.executor.torch.kernels.build import KernelBuildError, build_library

logger = logging.getLogger(__name__)

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


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


class PrefillAttentionKernel:
    """Causal attention of a prefill chunk's bfloat16 queries over its context's keys and values."""

    __slots__ = ("_attend", "max_head_dim")

    def __init__(self, lib: ctypes.CDLL, max_head_dim: int) -> None:
        self._attend = lib.llmsched_prefill_attention
        self._attend.argtypes = [
            _P,
            _L,
            _L,
            _P,
            _L,
            _L,
            _P,
            _L,
            _L,
            _P,
            _L,
            _L,
            _I,
            _I,
            _I,
            _I,
            _I,
            ctypes.c_float,
            _I,
        ]
        self._attend.restype = None
        self.max_head_dim = max_head_dim

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this kernel runs a layer of this dtype and head size."""
        return dtype == torch.bfloat16 and head_dim % 64 == 0 and head_dim <= self.max_head_dim

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
    ) -> None:
        """out [lq, heads, d] = attention of q [lq, heads, d] over k, v [lk, kv_heads, d].

        Query i sees keys 0..lk-lq+i. Any strides, with each row's head_dim
        values contiguous.
        """
        lq, nh, d = q.shape
        lk, kvh, _ = k.shape
        self._attend(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            lq, lk, nh, kvh, d, scale, torch.get_num_threads(),
        )  # fmt: skip


# PyTorch splits one long row's sum over threads past its grain size (32768).
MAX_NORM_WIDTH = 32768


class ElementwiseKernels:
    """RMSNorm over bfloat16 rows, alone or after the residual add, with the PyTorch path's bits."""

    __slots__ = ("_add_norm", "_norm", "lanes")

    def __init__(self, lib: ctypes.CDLL, lanes: int) -> None:
        self._norm = lib.llmsched_rms_norm
        self._norm.argtypes = [_P, _L, _L, _I, _I, _I, _P, ctypes.c_float, _I, _P, _L, _L, _I]
        self._norm.restype = None
        self._add_norm = lib.llmsched_add_rms_norm
        self._add_norm.argtypes = [_P, _L, _P, _L, _I, _I, _P, ctypes.c_float, _I, _P, _L, _I]
        self._add_norm.restype = None
        # PyTorch's float vector width, which sets the order of its sums.
        self.lanes = lanes

    @staticmethod
    def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether x ([tokens, h] or [tokens, heads, h], rows contiguous) and weight [h] suit the kernels."""
        return (
            x.dtype == weight.dtype == torch.bfloat16
            and x.dim() in (2, 3)
            and x.stride(-1) == 1
            and weight.dim() == 1
            and weight.shape[0] == x.shape[-1]
            and weight.is_contiguous()
            and x.shape[-1] <= MAX_NORM_WIDTH
            and x.device.type == "cpu"
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x's last dim, scaled by weight, as a new contiguous tensor."""
        out = torch.empty(x.shape, dtype=x.dtype)
        x3, o3 = (x, out) if x.dim() == 3 else (x[:, None], out[:, None])
        self._norm(
            x3.data_ptr(), x3.stride(0), x3.stride(1), *x3.shape, weight.data_ptr(),
            eps, self.lanes, o3.data_ptr(), o3.stride(0), o3.stride(1), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (both [tokens, h]), then the RMSNorm of x."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self._add_norm(
            x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0), x.shape[0], x.shape[1],
            weight.data_ptr(), eps, self.lanes, out.data_ptr(), out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return out


def clear_caches() -> None:
    """Forget the loaded library and kernels, so the next call looks again (the environment, the compiler)."""
    for cached in (library, decode_attention, prefill_attention, elementwise):
        cached.cache_clear()


def enabled() -> bool:
    """False when ``LLMSCHED_CPU_KERNELS`` is 0 (or off/false/no): the PyTorch paths run."""
    return os.environ.get("LLMSCHED_CPU_KERNELS", "1").strip().lower() not in ("0", "off", "false", "no")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels' library, built on first use if need be; None when off or unbuildable (logged once)."""
    if not enabled():
        return None
    try:
        # torch is imported first, so the library's OpenMP resolves to the
        # runtime torch already loaded: one thread pool, not two.
        return ctypes.CDLL(str(build_library()))
    except (KernelBuildError, OSError) as e:
        logger.warning("CPU kernels unavailable, running the PyTorch path: %s", e)
        return None


@functools.cache
def decode_attention() -> DecodeAttentionKernels | None:
    """The decode attention kernels, or None when the library is off or unbuildable."""
    lib = library()
    return None if lib is None else DecodeAttentionKernels(lib)


@functools.cache
def prefill_attention() -> PrefillAttentionKernel | None:
    """The prefill attention kernel; None when the library is off or unbuilt or the CPU lacks AVX-512 BF16."""
    lib = library()
    if lib is None:
        return None
    max_head_dim = lib.llmsched_prefill_supported()
    return PrefillAttentionKernel(lib, max_head_dim) if max_head_dim > 0 else None


def _sum_order_lanes(lib: ctypes.CDLL) -> int | None:
    """The vector width (8 or 16 lanes) with which the kernel's sums of squares have this PyTorch's bits.

    PyTorch's sum adds a row as float vectors of a width its build picks
    (8 lanes in 2.13's AVX2 and AVX-512 kernels alike); the kernel follows
    either, so it is checked here against rows whose sums show their order.
    """
    fn = lib.llmsched_sum_squares
    fn.argtypes = [_P, _L, _I, _I, _I, _P]
    fn.restype = None
    g = torch.Generator().manual_seed(0)
    rows = [
        (torch.randn(64, h, generator=g) * torch.logspace(-3, 3, 64)[:, None]).bfloat16()
        for h in _PROBE_WIDTHS
    ]
    for lanes in (8, 16):
        ok = True
        for x in rows:
            sums = torch.empty(x.shape[0])
            fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], lanes, sums.data_ptr())
            ok = ok and torch.equal(sums / x.shape[1], x.float().square().mean(-1))
        if ok:
            return lanes
    return None


# Row widths whose sums exercise every part of the order: under one vector,
# leftover scalars, leftover vectors, whole groups of 4, and the cascade
# over 16 groups.
_PROBE_WIDTHS = (7, 13, 24, 100, 576, 4096 + 40)


@functools.cache
def elementwise() -> ElementwiseKernels | None:
    """The RMSNorm kernels; None when the library is off or unbuilt, or cannot give this PyTorch's bits."""
    lib = library()
    if lib is None:
        return None
    lanes = _sum_order_lanes(lib)
    if lanes is None:
        logger.warning("CPU RMSNorm kernel off: its sums do not match this PyTorch's order")
        return None
    return ElementwiseKernels(lib, lanes)
