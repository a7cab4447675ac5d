"""Device, dtype and CPU thread choices, and how much memory the host has free."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from llmsched.core.errors import ConfigError
from llmsched.executor.platform import usable_cores
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


# vLLM 0.33's supported dtypes on CUDA by compute capability, preferred first
# (its platform's supported_dtypes: bfloat16 from Ampere on, float16 from Pascal).
def cuda_dtypes(capability: tuple[int, int]) -> tuple[torch.dtype, ...]:
    """The dtypes vLLM runs on a GPU of this compute capability, the one ``auto`` prefers first."""
    if capability >= (8, 0):
        return (torch.bfloat16, torch.float16, torch.float32)
    if capability >= (6, 0):
        return (torch.float16, torch.float32)
    return (torch.float32,)


def cpu_dtypes(bf16_matmuls: bool) -> tuple[torch.dtype, ...]:
    """The dtypes this executor runs on CPU, the one ``auto`` prefers first.

    vLLM's CPU list (x86, Arm Linux) is bfloat16, float16, float32. float16
    is refused here (its CPU matmuls are emulated); bfloat16 is preferred only
    where the CPU has bfloat16 matmuls, since elsewhere PyTorch emulates them
    far slower than float32 (vLLM prefers it anyway).
    """
    return (torch.bfloat16, torch.float32) if bf16_matmuls else (torch.float32, torch.bfloat16)


@functools.cache
def cpu_bf16_matmuls() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively (oneDNN's bf16 path: AVX-512 or Arm BF16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def auto_dtype(checkpoint: torch.dtype, supported: tuple[torch.dtype, ...]) -> torch.dtype:
    """vLLM's ``dtype="auto"``: float32 takes the preferred dtype; others keep theirs where supported."""
    preferred = supported[0]
    wanted = preferred if checkpoint is torch.float32 else checkpoint
    return wanted if wanted in supported else preferred


def checkpoint_dtype(config: ModelConfig) -> torch.dtype | None:
    """The float32/bfloat16/float16 dtype config.json declares (torch_dtype or dtype), else None."""
    return _DTYPES.get(str(config.torch_dtype).lower()) if config.torch_dtype else None


def choose_dtype(
    dtype: str | torch.dtype, config: ModelConfig, device: torch.device
) -> tuple[torch.dtype, str]:
    """The compute and KV dtype, and a start-up line saying how it was chosen.

    'auto' resolves as vLLM 0.33 does: a float32 checkpoint (or one that
    declares no dtype, read as float32) runs in the platform's preferred
    dtype, bfloat16 on CPUs with bfloat16 matmuls and on Ampere or later
    GPUs, float16 on older GPUs; float16 and bfloat16 checkpoints keep
    theirs where the platform runs it, else take the preferred one. On CPU
    a float16 checkpoint runs in the preferred dtype (vLLM keeps float16):
    float16 is refused there. A CPU without bfloat16 matmuls runs every
    checkpoint in float32 (vLLM would run bfloat16, emulated).
    """
    if isinstance(dtype, torch.dtype) or dtype != "auto":
        dt = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype).lower())
        if dt is None:
            raise ConfigError(f"dtype={dtype!r} is not supported; use auto, float32, bfloat16 or float16")
        note = f"dtype {dtype_name(dt)} (as asked)"
    else:
        declared = checkpoint_dtype(config)
        ckpt = torch.float32 if declared is None else declared
        if device.type == "cpu":
            bf16 = cpu_bf16_matmuls()
            # Without bf16 matmuls PyTorch emulates them several times slower
            # than float32 (about 7x on an AVX2 EPYC): every checkpoint runs
            # float32 there, at twice the weight memory.
            dt = auto_dtype(ckpt, cpu_dtypes(bf16)) if bf16 else torch.float32
        else:
            dt = auto_dtype(ckpt, cuda_dtypes(torch.cuda.get_device_capability(device)))
        note = _auto_note(declared, dt, device)
    if device.type == "cpu" and dt is torch.float16:
        raise ConfigError("dtype=float16 is not supported on CPU; use bfloat16 or float32")
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"dtype={dt} is not supported; use float32, bfloat16 or float16")
    return dt, note


def dtype_name(dt: torch.dtype) -> str:
    """``torch.float32`` as config.json and the ``dtype`` argument spell it: ``float32``."""
    return str(dt).removeprefix("torch.")


def _auto_note(declared: torch.dtype | None, dt: torch.dtype, device: torch.device) -> str:
    """The start-up line for dtype auto: the checkpoint's dtype, the one chosen, and how vLLM compares."""
    ckpt = torch.float32 if declared is None else declared
    named = "float32 (none declared)" if declared is None else dtype_name(declared)
    chosen = "kept" if dt is ckpt else f"-> {dtype_name(dt)}"
    where = "CPU" if device.type == "cpu" else "CUDA"
    if device.type == "cpu" and ckpt is torch.float16:
        why = "vLLM keeps float16; float16 is not supported on CPU here"
    elif device.type == "cpu" and dt is torch.float32:
        why = "this CPU has no bfloat16 matmuls; vLLM would run bfloat16"
    else:
        why = f"as vLLM does on {where}"
    return f"dtype auto: checkpoint {named} {chosen} ({why})"


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """The compute and KV dtype (see ``choose_dtype``)."""
    return choose_dtype(dtype, config, device)[0]


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads (default: every core we may use, within a quota); returns the count."""
    n = usable_cores() if num_threads is None else num_threads
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
