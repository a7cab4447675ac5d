"""Named hardware profile files: a calibration's fitted figures with its evidence, kept and compared.

``llmsched calibrate`` writes one; ``llmsched simulate --hardware FILE``
(and ``load_hardware``) reads it back. The file holds the profile itself
(``hardware``: HardwareProfile's fields) and the calibration behind it
(``calibration``: the raw figures, each figure's spread and settling, the
other processes' share of the cores, the machine and library versions), so
two profiles taken on different days can be compared figure by figure.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.hardware import PROFILE_FORMAT as FORMAT
from llmsched.executor.sim.hardware import HardwareProfile, is_profile_file, profile_from_file_data
from llmsched.sim.calibrate import profile_from_calibration

__all__ = [
    "FITTED",
    "FORMAT",
    "compare",
    "is_profile_file",
    "profile_from_file_data",
    "read_calibration",
    "write_profile",
]
# The calibration's fitted figures, as ``compare`` reports them.
FITTED = (
    "peak_flops",
    "mem_bandwidth",
    "memory_efficiency",
    "attention_efficiency",
    "decode_kv_bandwidth",
    "step_overhead_s",
    "layer_overhead_s",
    "request_overhead_s",
)


def write_profile(path: str | Path, calibration: dict, name: str | None = None) -> HardwareProfile:
    """Write the calibration as a named profile file; returns the profile."""
    path = Path(path)
    hw = profile_from_calibration(calibration, name or path.stem)
    data = {"format": FORMAT, "hardware": hw.to_dict(), "calibration": calibration}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return hw


def read_calibration(path: str | Path) -> dict:
    """The calibration record of a profile file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"hardware profile {str(path)!r} cannot be read: {e}") from e
    if not is_profile_file(data) or not isinstance(data.get("calibration"), dict):
        raise ConfigError(f"{str(path)!r} is not a calibrated profile file ({FORMAT})")
    return data["calibration"]


def compare(a: dict, b: dict) -> list[tuple[str, float, float, float]]:
    """(figure, a, b, b / a - 1) for every fitted figure both calibrations have."""
    rows = []
    for key in FITTED:
        x, y = a.get(key), b.get(key)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x > 0 and math.isfinite(x):
            rows.append((key, float(x), float(y), y / x - 1.0))
    return rows
