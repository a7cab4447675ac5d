"""Loading the kernels' shared library once per process (built first if need be), or saying why not."""

from __future__ import annotations

import ctypes
import functools
import logging
import os

from llmsched.executor.torch.kernels.build import KernelBuildError, build_library

logger = logging.getLogger(__name__)

# ctypes argument types: pointers, ints, int64s.
ARGS_P, ARGS_I, ARGS_L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


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
