"""Settings, the balance gate and the shared prefill cadence, one at a time."""

from __future__ import annotations

import pytest

from llmsched.core import ConfigError, Reason, SchedulerConfig
from llmsched.core.scheduler import Scheduler
from llmsched.engine.dp import BalanceGate, DPConfig, PrefillCadence, lockstep_for


def test_config_validation_names_the_problem() -> None:
    with pytest.raises(ConfigError, match="data_parallel_size"):
        DPConfig(0)
    with pytest.raises(ConfigError, match="lock-stepped ranks"):
        DPConfig(2, lockstep=False, balance_scheduling=True)
    with pytest.raises(ConfigError, match="sync_interval=4"):
        DPConfig(2, balance_scheduling=True, sync_interval=4)
    with pytest.raises(ConfigError, match="prefill_schedule_interval"):
        DPConfig(2, prefill_schedule_interval=0)


def test_the_cadence_is_shared_in_lockstep_and_local_otherwise() -> None:
    lock = DPConfig(2, lockstep=True, prefill_schedule_interval=4)
    ind = DPConfig(2, lockstep=False, prefill_schedule_interval=4)
    assert lock.shared_cadence and lock.rank_prefill_interval == 1
    assert not ind.shared_cadence and ind.rank_prefill_interval == 4


def test_mode_resolution() -> None:
    assert lockstep_for(is_moe=True) is True
    assert lockstep_for(is_moe=False) is False
    assert lockstep_for(is_moe=False, mode="lockstep") is True
    with pytest.raises(ConfigError, match="must step together"):
        lockstep_for(is_moe=True, mode="independent")
    with pytest.raises(ConfigError, match="unknown"):
        lockstep_for(is_moe=True, mode="sometimes")


def test_the_gate_holds_only_for_other_full_ranks() -> None:
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=32, max_num_seqs=4))
    full_here = Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=32, max_num_seqs=4))
    full_here.running = [object()] * 4  # type: ignore[list-item]
    gate = BalanceGate(rank=1, num_ranks=3, max_num_seqs=4)
    assert gate.reason is Reason.BALANCE_GATE
    assert gate(sched) is None
    gate.observe([3, 4, 2])  # only this rank (1) is full: its own cap applies, not the gate
    assert gate(sched) is None
    gate.observe([4, 4, 2])
    assert gate(sched) == "rank 0 at max_num_seqs=4"
    gate.observe([4, 1, 5])
    assert gate(sched) == "ranks 0, 2 at max_num_seqs=4"
    # When this rank is full too, its own cap speaks (the scheduler's reason).
    assert gate(full_here) is None
    assert gate.num_held == 2


def test_cadence_throttles_between_every_nth_step_and_restarts_after_idle() -> None:
    c = PrefillCadence(3)
    pattern = []
    for _ in range(7):
        pattern.append(c.throttle())
        c.advance(group_running=True)
    assert pattern == [False, True, True, False, True, True, False]
    c.advance(group_running=False)
    assert c.counter == 0 and not c.throttle()
    one = PrefillCadence(1)
    for _ in range(3):
        assert not one.throttle()
        one.advance(True)
