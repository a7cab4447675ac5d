"""Other processes' share of the cores, read from /proc while we idle or work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from llmsched.sim import machine_load


def test_own_work_is_not_counted_as_foreign():
    if machine_load.busy_seconds() is None:
        pytest.skip("no /proc/stat here")
    a = machine_load.sample()
    x = 0
    for i in range(2_000_000):
        x += i
    b = machine_load.sample()
    # Our own busy loop is ours; whatever else ran is bounded by the other cores.
    assert machine_load.foreign_share(a, b) <= 1.0
    assert b.own_s >= a.own_s


def test_a_busy_neighbour_is_seen_and_named():
    if machine_load.busy_seconds() is None:
        pytest.skip("no /proc/stat here")
    # Through a shell that stays its parent: a process of someone else's
    # (this process's own children are not named, its probe being one).
    code = f"{sys.executable} -c 'while True: pass'; true"
    hog = subprocess.Popen(["sh", "-c", code], start_new_session=True)
    try:
        # The shell starts its child when the scheduler lets it: wait for it, not a fixed time.
        deadline = time.monotonic() + 60
        children: list[str] = []
        while not children:
            assert time.monotonic() < deadline, "the busy process never started"
            time.sleep(0.05)
            with open(f"/proc/{hog.pid}/task/{hog.pid}/children") as f:
                children = f.read().split()
        python_pid = int(children[0])
        a = machine_load.sample(with_processes=True)
        time.sleep(0.5)
        b = machine_load.sample(with_processes=True)
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()
    # One busy process is at least half a core's worth, even on a shared machine.
    cores = os.cpu_count() or 1
    assert machine_load.foreign_share(a, b) >= 0.5 / cores
    named = machine_load.busiest_others(a, b, n=1000)
    assert any(f"pid {python_pid})" in who for who in named), named


def test_wait_for_quiet_stops_at_the_first_quiet_window(monkeypatch):
    shares = iter([0.9, 0.5, 0.05, 0.9])
    monkeypatch.setattr(machine_load, "quiet_check", lambda s: machine_load.QuietCheck(next(shares), []))
    assert machine_load.wait_for_quiet(0.1, timeout_s=60).share == 0.05


def test_wait_for_quiet_gives_up_at_the_timeout(monkeypatch):
    monkeypatch.setattr(machine_load, "quiet_check", lambda s: machine_load.QuietCheck(0.9, ["x"]))
    assert machine_load.wait_for_quiet(0.1, timeout_s=0.0).share == 0.9
