"""Process settings that make PyTorch's CPU allocations cheap.

Each step allocates activations of a few MiB to a few hundred MiB. glibc
serves allocations above its mmap threshold with fresh mmap()s and returns
them on free, so every step page-faults its activations in again (measured:
a large index_select ran 4x slower than into a reused buffer). Raising the
mmap threshold and the trim threshold keeps freed memory in the heap for
the next step. This changes process-wide malloc behaviour; the cost is that
the process keeps its peak heap instead of returning it to the OS.

The KV cache is also asked for transparent huge pages: decode attention
gathers 2 KiB blocks from all over a multi-GiB cache, and with 4 KiB pages
nearly every block costs a TLB miss. Measured on a 2-core Zen4: the gather
ran 1.4x faster from 2 MiB pages, and small-batch decode steps over long
contexts (8-16 requests) 25-30% faster.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit hosts (HEAP_MAX / 2).
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30
_HUGE_PAGE = 2 << 20
_done = False


def tune_cpu_allocator() -> bool:
    """Apply the glibc malloc settings once per process; False where glibc is not in use."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    if not ok:
        log.debug("mallopt refused the allocator settings")
    _done = ok
    return ok


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on fresh anonymous memory, 2 MiB aligned and advised onto transparent huge pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None or nbytes < _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    # A private anonymous mapping reads as zeros and is faulted in on first
    # write, so a large cache costs nothing until used (like calloc). Private:
    # a shared one is shmem, which THP usually leaves on small pages.
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    try:
        buf.madvise(advise, start, nbytes)
    except OSError as e:
        log.debug("madvise(MADV_HUGEPAGE) failed (%s); the KV cache uses ordinary pages", e)
    return raw[start : start + nbytes].view(dtype).view(shape)
