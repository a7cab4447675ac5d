"""A hand-made 2-rank case: the balance gate holds and releases admissions at the right steps.

Each rank runs at most 2 requests. Rank 0: A (3 tokens), B (long), then C
waits. Rank 1: D (6 tokens), E (long), then F waits. Prompts fit one step,
so a request samples a token in every step from its admission on, and one
with max_tokens k finishes in the step k - 1 steps after it was admitted.

- step 0: both ranks admit two requests (the gate has seen nothing yet);
- step 2: A finishes, rank 0 runs 1; rank 1 still runs 2 (full);
- steps 3-5: rank 0 would admit C, but rank 1 is full: the gate holds it
  (without balance scheduling C goes in at step 3);
- step 5: D finishes, so after it no rank is full;
- step 6: both ranks admit, C and F in the same step.
"""

from __future__ import annotations

from llmsched.core import Reason, Request, SamplingParams, SchedulerConfig
from llmsched.engine.dp import DPConfig
from llmsched.engine.dp.sim_transport import SimTransport
from llmsched.executor.sim.cost_model import ConstantCostModel

PLAN = {0: [("A", 3), ("B", 50), ("C", 4)], 1: [("D", 6), ("E", 50), ("F", 4)]}


def run(balance: bool, steps: int = 9) -> tuple[dict[str, tuple[int, int]], list[dict[int, object]]]:
    """(request -> (rank, step admitted)), and each step's trace per rank."""
    cfg = SchedulerConfig(num_gpu_blocks=64, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=2)
    tr = SimTransport(cfg, ConstantCostModel(1.0), DPConfig(2, lockstep=True, balance_scheduling=balance))
    for r in tr.ranks:
        r.scheduler.enable_trace()
    for rank, reqs in PLAN.items():
        for i, (rid, n) in enumerate(reqs):
            tr.add_request(
                rank, Request(rid, [10 + i, 11, 12, 13], SamplingParams(max_tokens=n, ignore_eos=True))
            )
    admitted: dict[str, tuple[int, int]] = {}
    traces: list[dict[int, object]] = []
    for step in range(steps):
        reports = tr.step()
        traces.append({rep.rank: rep.engine_step.scheduler_output.trace for rep in reports})
        for rep in reports:
            for req in rep.engine_step.scheduler_output.admitted:
                admitted[req.request_id] = (rep.rank, step)
    return admitted, traces


def test_the_gate_holds_c_until_no_rank_is_full_then_both_ranks_admit_together() -> None:
    admitted, traces = run(balance=True)
    assert admitted == {"A": (0, 0), "B": (0, 0), "D": (1, 0), "E": (1, 0), "C": (0, 6), "F": (1, 6)}
    for step in (3, 4, 5):
        entry = traces[step][0].reason_of("C")
        assert entry is not None and entry.reason is Reason.BALANCE_GATE
        assert entry.detail == "rank 1 at max_num_seqs=2"
        # Rank 1 is held by its own cap, which the trace names as such.
        assert traces[step][1].reason_of("F").reason is Reason.MAX_NUM_SEQS
    assert "held by the data-parallel balance gate" in traces[4][0].explain()
    # Before A finished, C waited for rank 0's own cap, not for the gate.
    assert traces[1][0].reason_of("C").reason is Reason.MAX_NUM_SEQS


def test_without_balance_scheduling_c_goes_in_as_soon_as_its_rank_has_room() -> None:
    admitted, traces = run(balance=False)
    assert admitted["C"] == (0, 3)
    assert admitted["F"] == (1, 6)
    assert all(e.reason is not Reason.BALANCE_GATE for t in traces for tr in t.values() for e in tr.entries)
