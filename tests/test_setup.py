"""The README's `make test` sets up a fresh machine by itself, and CI adds nothing to it."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The pd extra (Mooncake's transfer engine) is installed only here.
PD_PLATFORM = sys.platform == "linux" and platform.machine() == "x86_64"
MOONCAKE_DIST = "mooncake-transfer-engine-non-cuda"
# glibc and the C++ runtime: any system that runs CPython and torch has them.
RUNTIME = {
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "libresolv.so.2",
    "libutil.so.1",
    "ld-linux-x86-64.so.2",
    "libstdc++.so.6",
    "libgcc_s.so.1",
}


def _commands(script: Path) -> list[str]:
    """The script's command lines, comments and blank lines dropped."""
    lines = (line.split("#", 1)[0].strip() for line in script.read_text().splitlines())
    return [line for line in lines if line]


def test_ci_runs_the_readme_test_command_and_nothing_else() -> None:
    """Anything CI set up beyond `make test` would hide a gap in the Makefile's set-up."""
    commands = _commands(ROOT / ".ci" / "run")
    preamble = {"set -euo pipefail", 'cd "$(dirname "$0")/.."'}
    assert [c for c in commands if c not in preamble] == ["make test"]


def test_make_test_installs_the_system_libraries_before_the_virtualenv() -> None:
    """`make test` on a fresh machine runs tools/system_libs.sh first, then builds .venv."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed, so the README's set-up cannot be read")
    for target in ("test", "demo"):
        dry = subprocess.run(
            ["make", "-n", "-B", target, "VENV=/nonexistent-venv"],
            cwd=ROOT,
            # Run under `make test`, the outer make's flags must not leak in.
            env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        libs = next((i for i, c in enumerate(dry) if "tools/system_libs.sh" in c), None)
        venv = next((i for i, c in enumerate(dry) if "-m venv" in c), None)
        assert libs is not None, f"`make {target}` does not run tools/system_libs.sh: {dry}"
        assert venv is not None and libs < venv, dry


def _needed(path: Path) -> set[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"not an ELF64 LE file: {path}"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out: set[str] = set()
    for _, sh_type, _, _, offset, size, link, _, _, _ in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for pos in range(offset, offset + size, 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 1:  # DT_NEEDED
                out.add(data[strtab + val : data.index(b"\0", strtab + val)].decode())
    return out


@pytest.mark.skipif(not PD_PLATFORM, reason="the pd extra installs Mooncake only on Linux x86_64")
def test_setup_covers_every_system_library_mooncake_links() -> None:
    """Each library Mooncake's binaries need that its wheel lacks is one the set-up installs."""
    files = [f for f in importlib.metadata.files(MOONCAKE_DIST) or [] if ".so" in f.name]
    assert files, f"{MOONCAKE_DIST} ships no shared objects: has its layout changed?"
    bundled = {f.name for f in files}
    needed = set().union(*(_needed(Path(f.locate())) for f in files))
    listed = subprocess.run(
        ["bash", str(ROOT / "tools" / "system_libs.sh"), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()[::2]
    uncovered = needed - bundled - RUNTIME - set(listed)
    assert not uncovered, f"{MOONCAKE_DIST} links {sorted(uncovered)}: add them to tools/system_libs.sh"


@pytest.mark.skipif(not PD_PLATFORM, reason="the pd extra installs Mooncake only on Linux x86_64")
def test_mooncake_transfer_engine_imports() -> None:
    """The P/D tests need Mooncake's transfer engine to load in the installed environment."""
    try:
        importlib.import_module("mooncake.engine")
    except ImportError as e:
        pytest.fail(f"Mooncake's transfer engine does not load ({e}); `make test` runs tools/system_libs.sh")
