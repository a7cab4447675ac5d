"""How much of the machine other processes used while we measured (Linux /proc).

A calibration times this machine's cores; any other process running on them
meanwhile makes every figure look slower. On a two-core machine one busy
neighbour takes one of the two cores a two-thread matmul needs, and since
each parallel region waits for its slowest thread, the measured peak halves
while the readings stay perfectly steady. Steadiness alone therefore cannot
vouch for a figure: the calibration also measures the other processes' CPU
time over each measurement window, from the machine's busy time in
``/proc/stat`` less this process's (and its waited-for children's) own, and
names the busiest of them from ``/proc/<pid>/stat``.

Off Linux nothing can be read: ``sample`` gives None and the share is 0.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LoadSample:
    """The machine's and this process's CPU seconds at one instant, and each other process's."""

    wall: float
    busy_s: float
    own_s: float
    # pid -> (command name, CPU seconds), other processes only.
    others: dict[int, tuple[str, float]] = field(default_factory=dict)


def _clock_ticks() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100.0


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy since boot (/proc/stat); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (the guest columns are
    # already inside user). Steal counts as busy: another guest had the core.
    ticks = [int(x) for x in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _clock_ticks()


def own_seconds() -> float:
    """CPU seconds of this process and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _other_processes() -> dict[int, tuple[str, float]]:
    """CPU seconds of every process but this one and its children."""
    me = os.getpid()
    hz = _clock_ticks()
    out: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces.
        name = text[text.find("(") + 1 : text.rfind(")")]
        rest = text[text.rfind(")") + 2 :].split()
        if len(rest) < 13:
            continue
        pid, ppid = int(entry.name), int(rest[1])
        if pid == me or ppid == me:
            continue
        out[pid] = (name, (int(rest[11]) + int(rest[12])) / hz)
    return out


def sample(with_processes: bool = False) -> LoadSample | None:
    """The counters now; with ``with_processes`` each other process's CPU time too."""
    busy = busy_seconds()
    if busy is None:
        return None
    others = _other_processes() if with_processes else {}
    return LoadSample(time.perf_counter(), busy, own_seconds(), others)


def foreign_share(before: LoadSample | None, after: LoadSample | None, cores: int | None = None) -> float:
    """Share of the machine's cores other processes used between two samples (0 off Linux)."""
    if before is None or after is None:
        return 0.0
    cores = cores or os.cpu_count() or 1
    wall = max(after.wall - before.wall, 1e-9)
    foreign = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, foreign / (wall * cores))


def busiest_others(before: LoadSample | None, after: LoadSample | None, n: int = 3) -> list[str]:
    """The ``n`` other processes that used the most CPU between two samples, as 'name (pid): x s'."""
    if before is None or after is None:
        return []
    used = []
    for pid, (name, cpu) in after.others.items():
        prev = before.others.get(pid, (name, 0.0))[1]
        if cpu - prev > 0:
            used.append((cpu - prev, pid, name))
    used.sort(reverse=True)
    return [f"{name} (pid {pid}): {sec:.2f} s" for sec, pid, name in used[:n]]


@dataclass(frozen=True, slots=True)
class QuietCheck:
    """Other processes' share of the cores over an idle window, and the busiest of them."""

    share: float
    busiest: list[str]

    def describe(self) -> str:
        """One line: the share, and who used it."""
        who = f" ({'; '.join(self.busiest)})" if self.busiest else ""
        return f"other processes used {100 * self.share:.0f}% of the cores{who}"


def quiet_check(seconds: float = 0.3) -> QuietCheck:
    """Idle for ``seconds`` and report what others used meanwhile (all of it is theirs)."""
    a = sample(with_processes=True)
    time.sleep(seconds)
    b = sample(with_processes=True)
    return QuietCheck(round(foreign_share(a, b), 3), busiest_others(a, b))


def wait_for_quiet(max_share: float, timeout_s: float, window_s: float = 1.0) -> QuietCheck:
    """Watch ``window_s`` windows until others use at most ``max_share`` of the cores, or time runs out.

    Returns the last window's check: its share says whether it ended quiet.
    """
    deadline = time.monotonic() + timeout_s
    check = quiet_check(window_s)
    while check.share > max_share and time.monotonic() < deadline:
        check = quiet_check(window_s)
    return check
