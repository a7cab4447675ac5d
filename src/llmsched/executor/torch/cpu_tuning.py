"""Process settings that make PyTorch's CPU allocations cheap.

Each step allocates activations of a few MiB to a few hundred MiB. glibc
serves allocations above its mmap threshold with fresh mmap()s and returns
them on free, so every step page-faults its activations in again (measured:
a large index_select ran 4x slower than into a reused buffer). Raising the
mmap threshold and the trim threshold keeps freed memory in the heap for
the next step. This changes process-wide malloc behaviour; the cost is that
the process keeps its peak heap instead of returning it to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit hosts (HEAP_MAX / 2).
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30
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
