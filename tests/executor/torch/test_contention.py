"""The thread governor: one thread fewer per core other processes take, back up when they leave."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from llmsched.executor.platform import cgroup_cpu_limit
from llmsched.executor.torch import TorchExecutor
from llmsched.executor.torch.contention import (
    CHECK_EVERY_S,
    ThreadGovernor,
    governor_for,
    read_busy_seconds,
)


class FakeHost:
    """Busy seconds of the watched cores and our own CPU time, advanced by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0

    def advance(self, seconds: float, foreign_cores: float, own_cores: float = 1.0) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + foreign_cores) * seconds

    def governor(self, threads: int = 2, cpus: int = 2, readable: bool = True) -> ThreadGovernor:
        return ThreadGovernor(
            threads, cpus, lambda: self.busy if readable else None, lambda: self.own, lambda: self.now
        )


def windows(host: FakeHost, gov: ThreadGovernor, n: int, foreign: float) -> list[int | None]:
    out = []
    for _ in range(n):
        host.advance(CHECK_EVERY_S, foreign)
        out.append(gov.poll())
    return out


def test_a_taken_core_costs_a_thread_after_two_windows_and_comes_back():
    host = FakeHost()
    gov = host.governor()
    assert windows(host, gov, 3, foreign=0.1) == [None, None, None]
    assert windows(host, gov, 2, foreign=1.0) == [None, 1]
    assert gov.threads == 1
    assert windows(host, gov, 2, foreign=0.0) == [None, 2]


def test_one_busy_window_changes_nothing():
    host = FakeHost()
    gov = host.governor()
    got = [windows(host, gov, 1, foreign=f)[0] for f in (1.5, 0.0, 1.5, 0.0)]
    assert got == [None, None, None, None]


def test_never_more_than_the_ceiling_nor_fewer_than_one():
    host = FakeHost()
    gov = host.governor(threads=3, cpus=4)
    # One core of four taken: three are free, and three is the ceiling.
    assert windows(host, gov, 3, foreign=1.0) == [None, None, None]
    assert windows(host, gov, 2, foreign=6.0) == [None, 1]


def test_between_checks_nothing_is_read():
    host = FakeHost()
    calls = []
    gov = ThreadGovernor(2, 2, lambda: calls.append(1) or host.busy, lambda: host.own, lambda: host.now)
    host.advance(CHECK_EVERY_S / 10, 1.0)
    assert gov.poll() is None and len(calls) == 1  # the reading at construction only


def test_a_host_that_does_not_say_keeps_every_thread():
    host = FakeHost()
    gov = host.governor(readable=False)
    assert windows(host, gov, 4, foreign=2.0) == [None] * 4
    assert gov.threads == 2


def test_cgroup_quota(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("max 100000\n")
    assert cgroup_cpu_limit(str(f)) is None
    f.write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(f)) == 1.5
    assert cgroup_cpu_limit(str(tmp_path / "absent")) is None


def test_proc_stat_busy_time_of_the_watched_cores(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 90 9000 9 0 0 0 0 0\n"
        "cpu0 100 0 10 1000 5 0 0 0 0 0\n"
        "cpu1 200 50 20 2000 5 3 2 1 0 0\n"
        "intr 1 2 3\n"
    )
    tick = os.sysconf("SC_CLK_TCK")
    assert read_busy_seconds(frozenset({1}), str(stat)) == pytest.approx(276 / tick)
    assert read_busy_seconds(frozenset({0, 1}), str(stat)) == pytest.approx(386 / tick)
    assert read_busy_seconds(frozenset({0}), str(tmp_path / "none")) is None


def _spin(seconds: float, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc/stat")
def test_busy_loops_on_our_cores_take_threads_away():
    """Two processes spinning on the two watched cores: the kernel's accounting says so."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two usable CPUs")
    watched = frozenset(cpus)
    gov = ThreadGovernor(2, 2, lambda: read_busy_seconds(watched))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spin, args=(4 * CHECK_EVERY_S + 2.0, c)) for c in cpus]
    for p in procs:
        p.start()
    try:
        time.sleep(1.0)  # the children are up and spinning
        gov.poll()  # a fresh window
        got = []
        deadline = time.monotonic() + 4 * CHECK_EVERY_S
        while time.monotonic() < deadline and gov.threads == 2:
            time.sleep(CHECK_EVERY_S / 5)
            got.append(gov.poll())
    finally:
        for p in procs:
            p.join()
    assert gov.threads == 1, got


def test_the_executor_follows_its_governor_only_when_the_count_is_its_own(tiny_models):
    path = tiny_models["llama"].path
    fixed = TorchExecutor(path, dtype="float32", num_gpu_blocks=16, max_model_len=64, num_threads=2)
    assert fixed.governor is None
    fixed.close()
    assert governor_for(False, 4) is None and governor_for(True, 1) is None
    ex = TorchExecutor(path, dtype="float32", num_gpu_blocks=16, max_model_len=64, num_threads=2,
                       adaptive_threads=True)  # fmt: skip
    before = torch.get_num_threads()
    try:
        host = FakeHost()
        ex.governor = host.governor()
        host.advance(CHECK_EVERY_S, 1.0)
        ex._follow_governor()
        host.advance(CHECK_EVERY_S, 1.0)
        ex._follow_governor()
        assert ex.num_threads == 1 and ex.model.threads == 1
    finally:
        ex.close()
        torch.set_num_threads(before)


def test_a_cpu_quota_caps_the_default_thread_count(monkeypatch):
    from llmsched.engine.serve_threads import serving_threads
    from llmsched.executor import platform
    from llmsched.server.dp_backend import threads_per_rank

    monkeypatch.setattr(platform, "cgroup_cpu_limit", lambda path="": 1.5)
    # The executor's default, the served engine's and each DP rank's all see the quota.
    assert platform.usable_cores() == 1 and serving_threads() == 1 and threads_per_rank(1) == 1
    monkeypatch.setattr(platform, "cgroup_cpu_limit", lambda path="": None)
    assert platform.usable_cores() == len(os.sched_getaffinity(0)) == serving_threads()
