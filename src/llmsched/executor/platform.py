"""The platform an engine runs on, as batch defaults and cost-model profiles describe it."""

from __future__ import annotations

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
