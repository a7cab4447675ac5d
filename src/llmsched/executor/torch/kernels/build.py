"""Compiling the C kernels beside this file into one shared library cached per source, compiler and CPU.

Built with the system C compiler (``$CC``, else ``cc``) and OpenMP, for
this machine's CPU (``-march=native``), so the cache key includes the CPU's
model and flags: a cache directory shared between machines never hands one
a library built for another. ``make`` builds it at install time; a process
that finds it missing builds it on first use (a few seconds), and one
that cannot says why and runs the PyTorch path.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

from llmsched.executor.torch.embedded import cache_dir

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "decode_attention.c",
        "prefill_attention.c",
        "prefill_attention_f32.c",
        "rms_norm.c",
        "swiglu.c",
    )
)
HEADERS = (Path(__file__).with_name("bf16.h"),)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
LIBS = ("-lm",)


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled here (no compiler, or it failed)."""


def compiler() -> list[str]:
    """The C compiler command: ``$CC`` split as a shell would, else ``cc``."""
    return shlex.split(os.environ.get("CC", "cc")) or ["cc"]


def _cpu_signature() -> str:
    """The CPU's model name and flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(keep[:2])


def library_path() -> Path:
    """Where the library for this source, compiler and CPU lives (built or not)."""
    cc = compiler()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"no C compiler ({' '.join(cc)}): {e}") from e
    key = hashlib.sha256()
    sources = [src.read_bytes() for src in SOURCES + HEADERS]
    for part in (*sources, version.encode(), " ".join(FLAGS + LIBS).encode(), _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build_library(force: bool = False) -> Path:
    """The compiled library's path, compiling it first when missing (or ``force``)."""
    out = library_path()
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: processes building at once
    # never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [*compiler(), *FLAGS, *map(str, SOURCES), *LIBS, "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        Path(tmp).unlink(missing_ok=True)
        raise KernelBuildError(f"{' '.join(cmd)}: {e}") from e
    if done.returncode:
        Path(tmp).unlink(missing_ok=True)
        raise KernelBuildError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    return out
