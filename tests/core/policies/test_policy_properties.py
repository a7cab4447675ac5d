"""Hypothesis: under every policy, random workloads finish, invariants hold after every step,
sjf's aging bounds who can overtake a request, and fair keeps backlogged tenants level."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsched.core import Reason, Scheduler, SchedulerOutput
from llmsched.core.policies import POLICY_NAMES
from support.policy_driver import STEP_S, Spec, config, drive

_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALL = [*POLICY_NAMES, "fair+skip-admission", "sjf+skip-admission", "priority-preemptive+skip-admission"]


@st.composite
def workloads(draw: st.DrawFn, tenants: int = 3, all_at_once: bool = False) -> list[Spec]:
    """Up to 14 requests with random lengths, arrivals, priorities and tenants."""
    n = draw(st.integers(1, 14))
    return [
        Spec(
            f"r{i}",
            0 if all_at_once else draw(st.integers(0, 30)),
            draw(st.integers(1, 200)),
            draw(st.integers(1, 40)),
            priority=draw(st.integers(0, 2)),
            tenant=f"t{draw(st.integers(0, tenants - 1))}",
        )
        for i in range(n)
    ]


@_SETTINGS
@given(
    policy=st.sampled_from(ALL),
    specs=workloads(),
    blocks=st.integers(20, 80),
    seqs=st.integers(1, 6),
    budget=st.sampled_from([16, 48, 256]),
    async_scheduling=st.booleans(),
)
def test_every_policy_finishes_every_request_with_invariants_kept(
    policy: str, specs: list[Spec], blocks: int, seqs: int, budget: int, async_scheduling: bool
) -> None:
    cfg = config(
        policy=policy,
        async_scheduling=async_scheduling,
        num_gpu_blocks=blocks,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        policy_config={"ttft_slo_s": 0.5} if policy == "slo" else None,
    )
    run = drive(cfg, specs)  # debug=True: core invariants checked after every step
    assert set(run.finished) == {s.rid for s in specs}
    if policy != "slo":
        assert not run.declined
    for rid in set(run.finished) - run.declined:
        assert rid in run.first_scheduled


AGING = 2000.0  # tokens per second: 20 tokens per 10 ms step


@_SETTINGS
@given(specs=workloads(), seqs=st.integers(1, 3))
def test_sjf_aging_bounds_who_can_overtake(specs: list[Spec], seqs: int) -> None:
    """Nobody arriving more than (its remaining tokens) / aging after a request is admitted before it."""
    cfg = config(policy="sjf", policy_config={"aging_tokens_per_s": AGING}, max_num_seqs=seqs)
    run = drive(cfg, specs)
    by_id = {s.rid: s for s in specs}
    pos = {rid: k for k, rid in enumerate(run.admitted_order)}
    for x in specs:
        bound = (x.prompt_len + x.max_tokens) / AGING
        for y in specs:
            if pos[y.rid] < pos[x.rid]:
                assert (y.arrival_step - x.arrival_step) * STEP_S <= bound + 1e-9, (by_id[x.rid], y)


@_SETTINGS
@given(specs=workloads(tenants=3, all_at_once=True))
def test_fair_keeps_backlogged_tenants_within_one_request_of_each_other(specs: list[Spec]) -> None:
    """While every tenant still has requests waiting, the tokens charged to any two differ by at
    most one request's cost (VTC's bound: a factor of 1 + max_cost / share of each other)."""
    cfg = config(policy="fair", num_gpu_blocks=400, max_num_seqs=2)
    run = drive(cfg, specs)
    cost = {s.rid: s.prompt_len + 2 * s.max_tokens for s in specs}
    tenant = {s.rid: s.tenant for s in specs}
    remaining = {t: sum(1 for s in specs if s.tenant == t) for t in {s.tenant for s in specs}}
    charged = dict.fromkeys(remaining, 0)
    max_cost = max(cost.values())
    for rid in run.admitted_order:
        if min(remaining.values()) == 0:
            break
        charged[tenant[rid]] += cost[rid]
        remaining[tenant[rid]] -= 1
        assert max(charged.values()) - min(charged.values()) <= max_cost


@_SETTINGS
@given(specs=workloads(), blocks=st.integers(20, 60), seqs=st.integers(1, 4))
def test_priority_preemptive_never_leaves_higher_priority_waiting_behind_lower(
    specs: list[Spec], blocks: int, seqs: int
) -> None:
    """When admissions stop at a request for lack of KV blocks or slots, no request of lower
    priority admitted in an earlier step is still running (it would have been preempted)."""

    def check(s: Scheduler, out: SchedulerOutput) -> None:
        head = out.trace.entries and next(
            (e for e in out.trace.entries if e.reason in (Reason.KV_SHORT, Reason.MAX_NUM_SEQS)), None
        )
        if not head:
            return
        req = s.requests[head.request_id]
        admitted = set(out.admitted)
        lower = [r.request_id for r in s.running if r not in admitted and r.priority >= req.priority + 1]
        assert not lower, (head, lower)

    cfg = config(policy="priority-preemptive", num_gpu_blocks=blocks, max_num_seqs=seqs)
    run = drive(cfg, specs, trace=True, on_step=check)
    assert set(run.finished) == {sp.rid for sp in specs}


@_SETTINGS
@given(specs=workloads(), blocks=st.integers(20, 40), limit=st.integers(0, 5))
def test_skip_admission_skips_a_request_at_most_skip_limit_times(
    specs: list[Spec], blocks: int, limit: int
) -> None:
    cfg = config(policy="skip-admission", num_gpu_blocks=blocks, policy_config={"skip_limit": limit})
    run = drive(cfg, specs, trace=True)
    skips: dict[str, int] = {}
    for t in run.traces:
        for e in t.entries:
            if e.reason is Reason.SKIPPED_NO_ROOM:
                skips[e.request_id] = skips.get(e.request_id, 0) + 1
    assert all(n <= limit for n in skips.values()), skips
    assert set(run.finished) == {s.rid for s in specs}


@_SETTINGS
@given(specs=workloads(), slo=st.sampled_from([0.02, 0.1, 0.5]))
def test_slo_never_declines_a_request_that_produced_output(specs: list[Spec], slo: float) -> None:
    cfg = config(policy="slo", policy_config={"ttft_slo_s": slo, "prefill_tokens_per_s": 5000})
    run = drive(cfg, specs)
    assert not run.declined & run.sampled
    assert set(run.finished) == {s.rid for s in specs}
