"""The CPU model every benchmark result names: /proc/cpuinfo's "model name"."""

from __future__ import annotations

import re
from pathlib import Path

import hostcpu
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# Two logical CPUs as Linux lists them on x86: the model name repeats per processor.
X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme de pse

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""

# aarch64's /proc/cpuinfo has no "model name" line.
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""


def test_cpu_model_is_the_model_name_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(X86_CPUINFO)
    assert hostcpu.cpu_model(info) == "Intel(R) Xeon(R) Platinum 8480+"


def test_cpu_model_reads_this_machines_proc_cpuinfo() -> None:
    """The default source is the real /proc/cpuinfo: its first model name, or unknown without one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    found = re.search(r"^model name\s*:\s*(.+?)\s*$", text, re.MULTILINE)
    if found:
        assert hostcpu.cpu_model() == found.group(1)
    else:
        assert hostcpu.cpu_model().startswith("unknown")


@pytest.mark.parametrize("text", [ARM_CPUINFO, "", "model name\t:   \n"])
def test_cpu_model_without_a_model_name_says_unknown(tmp_path: Path, text: str) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert hostcpu.cpu_model(info).startswith("unknown")


def test_cpu_model_without_the_file_says_unknown(tmp_path: Path) -> None:
    assert hostcpu.cpu_model(tmp_path / "missing").startswith("unknown")


def test_record_cpu_adds_and_prints_the_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(X86_CPUINFO)
    monkeypatch.setattr(hostcpu, "CPUINFO", info)
    result = {"figure": 1.0}
    assert hostcpu.record_cpu(result) is result
    assert result["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert result["usable_cpus"] >= 1
    assert "Intel(R) Xeon(R) Platinum 8480+" in capsys.readouterr().out


# e2e_cpu_peers.py writes its child process's result for e2e_cpu.py, which records the CPU.
NOT_RESULTS = {"e2e_cpu_peers.py", "hostcpu.py"}


def test_every_benchmark_that_writes_json_records_the_cpu() -> None:
    writers = [
        p
        for p in sorted(BENCHMARKS.glob("*/*.py"))
        if p.name not in NOT_RESULTS and re.search(r"json\.dumps?\(", p.read_text())
    ]
    assert len(writers) > 20
    missing = [p.name for p in writers if "record_cpu(" not in p.read_text()]
    assert missing == []
