"""Device, dtype and CPU thread choices, and how much memory the host has free."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from llmsched.core.errors import ConfigError
from llmsched.executor.torch.config import ModelConfig

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


# KV block size when none is given: vLLM's own defaults, 16 tokens on CUDA and
# 128 on CPU. On CPU, decode attention reads every block of a request as
# separate rows; measured on a 2-core Zen4 at batch 64, 16-token blocks made
# decode steps ~8% slower than 32-128-token ones.
DEFAULT_BLOCK_SIZE = {"cpu": 128, "cuda": 16}


def default_block_size(device: torch.device) -> int:
    """The KV block size used on ``device`` when none is given."""
    return DEFAULT_BLOCK_SIZE[device.type]


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' is CUDA when present, else CPU; anything else must exist here."""
    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise ConfigError(f"device={device!r} is not a device name: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={str(dev)!r} was asked for but CUDA is not available in this PyTorch")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={str(dev)!r} is not supported (cpu or cuda)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """The compute and KV dtype.

    'auto': on CPU, float32 only when config.json says float32, else bfloat16
    (half the weight and KV traffic, and bf16 matmuls run on AVX512-BF16/AMX);
    on CUDA, the config's float16/bfloat16, or bfloat16 for a float32 model
    (float16 where the GPU lacks bf16). float16 is refused on CPU: its matmuls
    there are emulated and slow.
    """
    if isinstance(dtype, torch.dtype):
        dt = dtype
    elif dtype == "auto":
        declared = _DTYPES.get(str(config.torch_dtype).lower()) if config.torch_dtype else None
        if device.type == "cpu":
            dt = torch.float32 if declared is torch.float32 else torch.bfloat16
        elif declared in (torch.float16, torch.bfloat16):
            dt = declared
        else:
            dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dt = _DTYPES.get(str(dtype).lower())
        if dt is None:
            raise ConfigError(f"dtype={dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    if device.type == "cpu" and dt is torch.float16:
        raise ConfigError("dtype=float16 is not supported on CPU; use bfloat16 or float32")
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"dtype={dt} is not supported; use float32, bfloat16 or float16")
    return dt


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads (default: every CPU we may use); returns the count."""
    n = usable_cpus() if num_threads is None else num_threads
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"num_threads={num_threads!r} must be a positive integer")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch ops on this thread without OpenMP worker threads, then restore its setting."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def available_host_memory() -> int:
    """Bytes the kernel reports as available (MemAvailable), or physical memory if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30
