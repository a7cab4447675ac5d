"""Each policy's own decision, with the trace reason it files it under."""

from __future__ import annotations

import pytest

from llmsched.core import ConfigError, Reason, Request, SamplingParams, Scheduler, make_policy
from llmsched.core.policies.base import BasePolicy
from llmsched.core.policy import FCFSPolicy, PriorityPolicy
from support.policy_driver import Spec, config, drive


def reasons(run, rid: str) -> set[Reason]:
    """Every reason the trace filed ``rid`` under."""
    return {e.reason for t in run.traces for e in t.entries if e.request_id == rid}


def test_sjf_admits_the_shortest_first_and_aging_lets_the_old_long_one_ahead() -> None:
    specs = [Spec("r0", 0, 20, 40), Spec("r1", 1, 300, 40), Spec("r2", 2, 10, 5), Spec("r3", 2, 20, 5)]
    run = drive(config(policy="sjf", max_num_seqs=1), specs)
    assert run.admitted_order == ["r0", "r2", "r3", "r1"]
    # With strong aging (1000 tokens per 10 ms step), r1's one-step head start wins.
    aged = drive(config(policy="sjf", max_num_seqs=1, policy_config={"aging_tokens_per_s": 100000}), specs)
    assert aged.admitted_order == ["r0", "r1", "r2", "r3"]


def test_fair_alternates_between_a_heavy_and_a_light_tenant() -> None:
    specs = [Spec(f"r{i}", 0, 32, 8, tenant="heavy") for i in range(6)]
    specs += [Spec(f"r{10 + i}", 0, 32, 8, tenant="light") for i in range(2)]
    run = drive(config(policy="fair", max_num_seqs=1), specs)
    assert run.admitted_order[:4] == ["r0", "r10", "r1", "r11"]


def test_priority_preemptive_evicts_low_priority_work_for_a_waiting_high_priority_request() -> None:
    specs = [Spec("r0", 0, 32, 200, priority=5), Spec("r1", 0, 32, 200, priority=5), Spec("r2", 3, 32, 4)]
    run = drive(config(policy="priority-preemptive", max_num_seqs=2), specs, trace=True)
    assert run.first_scheduled["r2"] == 3
    assert Reason.PREEMPTED_FOR_WAITING in reasons(run, "r1")
    # Plain priority waits for a slot instead.
    plain = drive(config(policy="priority", max_num_seqs=2), specs)
    assert plain.first_scheduled["r2"] > 100


def test_skip_admission_runs_short_requests_past_one_that_does_not_fit() -> None:
    # 20 usable blocks of 16 tokens: r0 holds 12, r1 (needs 12) cannot fit, r2 (1) can.
    specs = [Spec("r0", 0, 180, 60), Spec("r1", 1, 190, 4), Spec("r2", 2, 10, 4)]
    cfg = {"num_gpu_blocks": 21, "max_num_batched_tokens": 256}
    run = drive(config(policy="skip-admission", **cfg), specs, trace=True)
    fcfs = drive(config(policy="fcfs", **cfg), specs)
    assert Reason.SKIPPED_NO_ROOM in reasons(run, "r1")
    assert run.first_scheduled["r2"] == 2
    assert fcfs.first_scheduled["r2"] >= fcfs.first_scheduled["r1"] > 2
    # A request is skipped at most skip_limit times, then admissions wait for it.
    capped = drive(config(policy="skip-admission", policy_config={"skip_limit": 0}, **cfg), specs)
    assert capped.admitted_order == fcfs.admitted_order


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first() -> None:
    s = Scheduler(config(policy="lpm", max_num_seqs=1, max_num_batched_tokens=512))
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    doc = list(range(100, 164))
    s.add_request(Request("warm", [*doc, 1], sp, arrival_time=0.0))
    out = s.schedule()
    from llmsched.core import ModelRunnerOutput

    s.update_from_output(out, ModelRunnerOutput([[7]]))
    s.add_request(Request("cold", list(range(500, 565)), sp, arrival_time=1.0))
    s.add_request(Request("hit", [*doc, 2], sp, arrival_time=1.1))
    out = s.schedule()
    assert [r.request_id for r in out.admitted] == ["hit"]


def test_slo_declines_what_cannot_meet_its_deadline_and_reports_it_finished() -> None:
    cfg = config(
        policy="slo", max_num_seqs=1, policy_config={"ttft_slo_s": 0.05, "prefill_tokens_per_s": 1e6}
    )
    specs = [Spec("r0", 0, 32, 30), Spec("r1", 0, 32, 4), Spec("r2", 0, 32, 4)]
    run = drive(cfg, specs, trace=True)
    assert "r0" not in run.declined and run.declined == {"r1", "r2"}
    assert Reason.DEADLINE_DECLINED in reasons(run, "r1")
    # Without declining, every request runs (late).
    keep = drive(config(policy="slo", max_num_seqs=1, policy_config={"decline": False}), specs)
    assert not keep.declined and len(keep.finished) == 3


def test_fair_with_skip_admission_holds_a_tenant_far_ahead() -> None:
    p = make_policy("fair+skip-admission", {"max_lead_tokens": 10})
    q = p.make_queue()
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    a, b = Request("a", [1] * 8, sp, tenant="A"), Request("b", [1] * 8, sp, tenant="B")
    q.add(a)
    q.add(b)
    p.counters.update({"A": 0.0, "B": 100.0})
    refusal = p.admit(b, None)
    assert refusal is not None and refusal[1] is Reason.FAIR_SHARE_HOLD
    assert p.admit(a, None) is None and p.counters["A"] == 8 + 2 * 4


def test_names_pick_vllm_exact_classes_and_reject_nonsense() -> None:
    assert isinstance(make_policy("fcfs"), FCFSPolicy) and isinstance(make_policy("priority"), PriorityPolicy)
    combo = make_policy("sjf+skip-admission")
    assert isinstance(combo, BasePolicy) and combo.skip and combo.name == "sjf+skip-admission"
    for bad in ("lifo", "sjf+fair", "skip-admission+skip-admission", "", "nomodule:"):
        with pytest.raises(ConfigError):
            make_policy(bad)
    with pytest.raises(ConfigError, match="aging_tokens_per_s"):
        make_policy("sjf", {"aging": 1})
    with pytest.raises(ConfigError, match="no knobs"):
        make_policy("fcfs", {"x": 1})
    with pytest.raises(ConfigError, match="cannot be loaded"):
        make_policy("no_such_module_xyz:Policy")


class LastInFirstOut(BasePolicy):
    """A user policy for the test: newest request first."""

    name = "lifo"

    def make_queue(self):
        from llmsched.core.policies.base import KeyedQueue

        return KeyedQueue(lambda r: -r.arrival_time)


def test_a_user_policy_loads_from_module_colon_class() -> None:
    specs = [Spec("r0", 0, 16, 30), Spec("r1", 1, 16, 2), Spec("r2", 2, 16, 2)]
    run = drive(config(policy=f"{__name__}:LastInFirstOut", max_num_seqs=1), specs)
    assert run.admitted_order == ["r0", "r2", "r1"]
