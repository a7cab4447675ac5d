"""The platform an engine runs on, as batch defaults and cost-model profiles describe it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Platform:
    """What the defaults depend on: device kind, its name and total memory, the world size."""

    kind: str  # "cpu" or "cuda"
    device_name: str = ""
    total_memory: int = 0  # bytes, as the driver reports the card's total
    # GB10 (DGX Spark, compute capability 12.1): large memory, small-card defaults.
    is_gb10: bool = False
    world_size: int = 1  # tensor x pipeline parallel ranks

    def describe(self) -> str:
        """A short name for logs: ``cpu`` or ``cuda (NVIDIA H100 80GB HBM3, 79.6 GiB)``."""
        if self.kind == "cpu":
            return "cpu"
        return f"cuda ({self.device_name or 'unknown device'}, {self.total_memory / GiB:.1f} GiB)"


def cgroup_cpu_limit(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """The container's CPU quota in cores (cgroup v2 ``cpu.max``), or None when unlimited or unknown."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def usable_cores() -> int:
    """Cores this process may use: its affinity, capped by a container's CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.floor(limit)))
    return cores
