"""The processor a benchmark ran on, named in its printout and its JSON.

``platform.processor()`` is empty on Linux, so the name comes from
/proc/cpuinfo's first "model name" line (what ``lscpu`` shows). Every
script under benchmarks/ that writes JSON passes its result through
:func:`record_cpu`, which adds the name under ``"cpu_model"`` and prints it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_model(cpuinfo: Path | None = None) -> str:
    """The first "model name" in ``cpuinfo`` (/proc/cpuinfo); elsewhere platform's guess, marked unknown."""
    try:
        text = (cpuinfo or CPUINFO).read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name" and value.strip():
            return value.strip()
    # No model name (not Linux, or an architecture whose cpuinfo lacks one):
    # say so rather than pass a bare architecture off as a processor.
    guess = platform.processor() or platform.machine()
    return f"unknown ({guess})" if guess else "unknown"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def record_cpu(result: dict) -> dict:
    """``result`` with ``cpu_model`` and ``usable_cpus`` set (in place); prints them."""
    result["cpu_model"] = cpu_model()
    result["usable_cpus"] = usable_cpus()
    print(f"cpu: {result['cpu_model']} ({result['usable_cpus']} usable CPUs)")
    return result
