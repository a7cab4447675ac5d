"""Fewer CPU threads while other processes take our cores: the default engine on a shared host.

Every parallel region of an OpenMP team waits for its slowest thread. When
another process runs on one of the engine's cores, the thread there gets a
time slice, not the core, and every region of every step waits for it: on
two cores with two busy loops beside it, a two-thread engine decoded 4.7x
slower than when quiet, a one-thread engine 2.2x. So an engine whose thread
count was not chosen by its user watches what the rest of the machine takes
of its cores and runs one thread fewer for each core taken, back up when
they are free again.

The measure is the kernel's own accounting: the busy time of the cores we
may run on (``/proc/stat``) minus our process's CPU time, over the last
half second. A host without ``/proc/stat`` keeps every thread.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

from llmsched.executor.platform import cgroup_cpu_limit

logger = logging.getLogger(__name__)

# How often the cores are looked at (seconds of wall time between steps).
CHECK_EVERY_S = 0.5
# Foreign load, in cores, below which a core counts as ours: the HTTP side
# of a served engine, a shell, a monitoring agent.
IDLE_SHARE = 0.35
# Windows in a row that must agree before the count changes (no flapping
# on one burst).
AGREE = 2


def read_busy_seconds(cpus: frozenset[int], path: str = "/proc/stat") -> float | None:
    """Busy (not idle, not iowait) seconds of ``cpus`` since boot, or None if the host does not say."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    try:
        with open(path) as f:
            for line in f:
                if not line.startswith("cpu") or line[3] == " ":
                    continue
                fields = line.split()
                if int(fields[0][3:]) not in cpus:
                    continue
                # user nice system idle iowait irq softirq steal ...
                values = [int(v) for v in fields[1:9]]
                busy += sum(values) - values[3] - values[4]
    except (OSError, ValueError, IndexError):
        return None
    return busy / tick


def governor_for(adaptive: bool, threads: int) -> ThreadGovernor | None:
    """A governor when the thread count is ours to change and we own the cores we run on, else None."""
    if not adaptive or threads < 2 or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = frozenset(os.sched_getaffinity(0))
    # Under a CPU quota the cores we run on are shared by design: their load says nothing of ours.
    limit = cgroup_cpu_limit()
    if limit is not None and limit < len(cpus):
        return None
    return ThreadGovernor(threads, len(cpus), lambda: read_busy_seconds(cpus))


class ThreadGovernor:
    """Chooses the engine's thread count from the load other processes put on its cores."""

    __slots__ = (
        "_agree",
        "_busy",
        "_clock",
        "_cpu",
        "_next",
        "_own",
        "_read",
        "_wall",
        "max_threads",
        "num_cpus",
        "threads",
    )

    def __init__(
        self,
        max_threads: int,
        num_cpus: int,
        read_busy: Callable[[], float | None],
        own_cpu: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max_threads
        self.num_cpus = num_cpus
        self.threads = max_threads
        self._read, self._own, self._clock = read_busy, own_cpu, clock
        self._busy, self._cpu, self._wall = read_busy(), own_cpu(), clock()
        self._next = self._wall + CHECK_EVERY_S
        self._agree = 0

    def poll(self) -> int | None:
        """The new thread count when it should change now, else None (cheap between checks)."""
        now = self._clock()
        if now < self._next:
            return None
        busy, cpu = self._read(), self._own()
        if busy is None or self._busy is None:
            self._next = math.inf  # the host does not say: keep every thread
            return None
        foreign = max(0.0, (busy - self._busy) - (cpu - self._cpu)) / (now - self._wall)
        self._busy, self._cpu, self._wall, self._next = busy, cpu, now, now + CHECK_EVERY_S
        free = self.num_cpus - foreign
        want = max(1, min(self.max_threads, math.floor(free + IDLE_SHARE)))
        if want == self.threads:
            self._agree = 0
            return None
        self._agree += 1
        if self._agree < AGREE:
            return None
        self._agree = 0
        logger.info(
            "CPU threads %d -> %d: other processes take %.1f of the %d cores this engine runs on",
            self.threads,
            want,
            foreign,
            self.num_cpus,
        )
        self.threads = want
        return want
