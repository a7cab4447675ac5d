"""The scripts under benchmarks/ import each other by module name, as when run from their folders.

A script run as ``python benchmarks/<group>/<name>.py`` finds its own folder's
modules (it is ``sys.path[0]``) and puts ``benchmarks/_common`` on the path
itself; here every group's folder and the shared one are on the path.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
for folder in sorted(p for p in BENCHMARKS.iterdir() if p.is_dir() and any(p.glob("*.py"))):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
