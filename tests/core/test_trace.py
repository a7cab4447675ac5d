"""The decision trace: off by default, never changes decisions, and explains every outcome."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from llmsched.bench.replay import replay
from llmsched.bench.workload import load_workload, parse_workload
from llmsched.core import (
    ModelRunnerOutput,
    Reason,
    Scheduler,
    SchedulerOutput,
    StepOutputs,
    StepTrace,
    TraceEntry,
)
from llmsched.core.trace import MAX_LISTED_WAITING
from support.scheduling import Pipeline, make_req
from support.scheduling import make_sched as base_sched

PARITY = Path(__file__).resolve().parents[1] / "data" / "parity"


def make_sched(trace: bool = True, **overrides: object) -> Scheduler:
    """The shared test scheduler, tracing on unless told otherwise."""
    s = base_sched(**overrides)
    if trace:
        s.enable_trace()
    return s


def run_step(sched: Scheduler, drafts: list[list[int]] | None = None) -> tuple[SchedulerOutput, StepOutputs]:
    """schedule(), then one token for each request that finished its known tokens."""
    out = sched.schedule()
    sampled = [[7] if r.num_computed_tokens >= r.num_tokens else [] for r in out.scheduled]
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled, draft_token_ids=drafts))


def entries(out: SchedulerOutput) -> list[tuple[str, Reason]]:
    """(request id, reason) of every trace entry, in order."""
    assert out.trace is not None
    return [(e.request_id, e.reason) for e in out.trace.entries]


def entry(out: SchedulerOutput, rid: str) -> TraceEntry:
    """The last trace entry for ``rid``."""
    assert out.trace is not None
    e = out.trace.reason_of(rid)
    assert e is not None, f"no trace entry for {rid}"
    return e


# ---- on and off -------------------------------------------------------------------------


def test_trace_is_off_by_default() -> None:
    s = make_sched(trace=False)
    s.add_request(make_req("A", 8))
    out, _ = run_step(s)
    assert out.trace is None


def test_trace_can_be_switched_on_and_off() -> None:
    s = make_sched(trace=False)
    s.add_request(make_req("A", 8))
    s.enable_trace()
    out, _ = run_step(s)
    assert isinstance(out.trace, StepTrace)
    assert out.trace.step == out.step
    s.enable_trace(False)
    out, _ = run_step(s)
    assert out.trace is None


def _strip(records: list[dict]) -> list[dict]:
    drop = {"why", "schedule_ns", "update_ns"}
    return [{k: v for k, v in r.items() if k not in drop} for r in records]


def _replay_records(workload_data: dict | Path, explain: bool) -> list[dict]:
    wl = load_workload(workload_data) if isinstance(workload_data, Path) else parse_workload(workload_data)
    buf = io.StringIO()
    replay(wl, buf, explain=explain)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert "header" in lines[0]
    return lines[1:]


def _stress_workload(policy: str) -> dict:
    requests = []
    for k in range(24):
        requests.append(
            {
                "id": f"q{k}",
                "arrival_step": (k * 3) % 11,
                "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8][: k % 9]
                + [100 * k + j for j in range(5 + 7 * k % 40)],
                "max_tokens": 3 + k % 13,
                "priority": k % 3,
                "lora_id": k % 4,
            }
        )
    return {
        "config": {
            "max_num_batched_tokens": 48,
            "max_num_seqs": 6,
            "block_size": 4,
            "num_gpu_blocks": 40,
            "long_prefill_token_threshold": 12,
            "policy": policy,
            "watermark": 0.05,
            "max_loras": 2,
        },
        "requests": requests,
    }


@pytest.mark.parametrize("name", sorted(p.name for p in PARITY.glob("*.workload.json")))
def test_tracing_never_changes_decisions_on_recorded_workloads(name: str) -> None:
    plain = _replay_records(PARITY / name, explain=False)
    traced = _replay_records(PARITY / name, explain=True)
    assert _strip(plain) == _strip(traced)
    assert all("why" in r for r in traced)
    assert not any("why" in r for r in plain)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_tracing_never_changes_decisions_under_pressure(policy: str) -> None:
    data = _stress_workload(policy)
    plain = _replay_records(data, explain=False)
    traced = _replay_records(data, explain=True)
    assert _strip(plain) == _strip(traced)
    # The workload exercises preemption and LoRA slot limits.
    reasons = {e[2] for r in traced for e in r["why"]["entries"]}
    assert {"preempted", "lora_slots_full", "no_admission_in_preempting_step"} <= reasons
    assert sum(len(r["preempted"]) for r in plain) > 0


# ---- one scenario per reason ------------------------------------------------------------


def test_scheduled_entries_describe_the_work() -> None:
    s = make_sched()
    s.add_request(make_req("A", 30))
    s.add_request(make_req("B", 50))
    out, _ = run_step(s)
    assert entries(out) == [("A", Reason.SCHEDULED), ("B", Reason.SCHEDULED)]
    a, b = entry(out, "A"), entry(out, "B")
    assert (a.num_tokens, a.detail) == (30, "admitted, prefill 0-30 of 30")
    assert (b.num_tokens, b.detail) == (34, "admitted, prefill 0-34 of 50, capped by the token budget")
    out, _ = run_step(s)
    assert entry(out, "A").detail == "decode"
    assert entry(out, "B").detail == "prefill 34-50 of 50"


def test_scheduled_capped_by_threshold() -> None:
    s = make_sched(long_prefill_token_threshold=8)
    s.add_request(make_req("A", 30))
    s.add_request(make_req("B", 30))
    out, _ = run_step(s)
    for rid in "AB":
        e = entry(out, rid)
        assert e.reason is Reason.SCHEDULED and e.num_tokens == 8
        assert e.detail.endswith("capped by long_prefill_token_threshold=8")


def test_scheduled_capped_by_max_model_len_with_drafts() -> None:
    s = make_sched(max_model_len=32, num_speculative_tokens=3)
    s.add_request(make_req("A", 28, max_tokens=4))
    run_step(s, drafts=[[1, 2, 3]])
    out, _ = run_step(s)
    e = entry(out, "A")
    assert e.num_tokens == 3
    assert e.detail == "decode with 2 draft tokens, capped by max_model_len=32"


def test_scheduled_with_a_prefix_hit_and_after_preemption() -> None:
    s = make_sched(num_gpu_blocks=8, max_model_len=64)
    s.add_request(make_req("A", 8, max_tokens=6))
    s.add_request(make_req("B", 8))
    for _ in range(5):
        run_step(s)
    out, _ = run_step(s)
    assert [r.request_id for r in out.preempted] == ["B"]
    out, _ = run_step(s)
    e = entry(out, "B")
    assert e.detail == "resumed with a prefix-cache hit of 12 tokens, decode"


def test_recompute_is_named_as_such() -> None:
    s = make_sched(num_gpu_blocks=8, max_model_len=64, enable_prefix_caching=False)
    s.add_request(make_req("A", 8, max_tokens=6))
    s.add_request(make_req("B", 8))
    for _ in range(6):
        run_step(s)
    out, _ = run_step(s)
    assert entry(out, "B").detail == "resumed, recompute 0-13 of 13"


def test_nothing_to_compute() -> None:
    # An executor that returns no token for a finished prefill (say, a
    # pipeline stage still in flight) leaves the request with nothing to do.
    s = make_sched()
    s.add_request(make_req("A", 8))
    s.add_request(make_req("B", 8))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput([[], [7]]))
    out, _ = run_step(s)
    assert entries(out) == [("A", Reason.NOTHING_TO_COMPUTE), ("B", Reason.SCHEDULED)]
    assert out.num_scheduled_tokens_by_id() == {"B": 1}


def test_running_request_reached_after_the_budget_ran_out() -> None:
    s = make_sched(max_num_batched_tokens=4, max_num_seqs=2, num_speculative_tokens=3)
    s.add_request(make_req("A", 2))
    s.add_request(make_req("B", 2))
    run_step(s, drafts=[[1, 2, 3], []])
    out, _ = run_step(s)
    assert entries(out) == [("A", Reason.SCHEDULED), ("B", Reason.BUDGET)]
    assert entry(out, "B").detail == "reached after the budget ran out"


def test_waiting_head_token_budget_spent_and_queued_behind() -> None:
    s = make_sched(max_num_batched_tokens=16)
    for rid in "ABCD":
        s.add_request(make_req(rid, 10))
    out, _ = run_step(s)
    assert entries(out) == [
        ("A", Reason.SCHEDULED),
        ("B", Reason.SCHEDULED),
        ("C", Reason.BUDGET),
        ("D", Reason.QUEUED),
    ]
    assert entry(out, "C").detail == "all 16 tokens of the step are used"
    assert entry(out, "D").detail == "behind C"


def test_max_num_seqs_reached() -> None:
    s = make_sched(max_num_seqs=2)
    for rid in "ABC":
        s.add_request(make_req(rid, 4))
    out, _ = run_step(s)
    e = entry(out, "C")
    assert (e.reason, e.detail) == (Reason.MAX_NUM_SEQS, "2 running")


def test_kv_blocks_short() -> None:
    s = make_sched(num_gpu_blocks=11, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4)
    s.add_request(make_req("A", 16, max_tokens=8))
    run_step(s)
    s.add_request(make_req("B", 28, max_tokens=1))
    out, _ = run_step(s)
    e = entry(out, "B")
    assert (e.reason, e.detail) == (Reason.KV_SHORT, "needs 7 blocks, 5 free")


def test_watermark() -> None:
    s = make_sched(num_gpu_blocks=21, max_model_len=128, watermark=0.1)
    s.add_request(make_req("A", 8, max_tokens=32))
    run_step(s)
    s.add_request(make_req("B", 64, max_tokens=1))
    out, _ = run_step(s)
    e = entry(out, "B")
    assert (e.reason, e.detail) == (Reason.WATERMARK, "needs 16 blocks, 17 free, 2 kept free")


def test_no_chunked_prefill() -> None:
    s = make_sched(enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=64)
    s.add_request(make_req("A", 40))
    s.add_request(make_req("B", 30))
    s.add_request(make_req("C", 10))
    out, _ = run_step(s)
    assert entries(out) == [("A", Reason.SCHEDULED), ("B", Reason.NO_CHUNKING), ("C", Reason.QUEUED)]
    assert entry(out, "B").detail == "needs 30 tokens, 24 left"


def test_lora_slots_full() -> None:
    s = make_sched(max_loras=1)
    s.add_request(make_req("A", 4, lora_id=1))
    s.add_request(make_req("B", 4, lora_id=2))
    s.add_request(make_req("C", 4, lora_id=1))
    out, _ = run_step(s)
    assert entries(out) == [("A", Reason.SCHEDULED), ("B", Reason.LORA_SLOTS), ("C", Reason.SCHEDULED)]
    assert entry(out, "B").detail == "1 adapters in use"


def test_set_aside_lora_request_is_not_listed_twice() -> None:
    s = make_sched(max_loras=1, max_num_seqs=2)
    s.add_request(make_req("A", 4, lora_id=1))
    s.add_request(make_req("B", 4, lora_id=2))
    s.add_request(make_req("C", 4, lora_id=1))
    s.add_request(make_req("D", 4))
    out, _ = run_step(s)
    assert entries(out) == [
        ("A", Reason.SCHEDULED),
        ("B", Reason.LORA_SLOTS),
        ("C", Reason.SCHEDULED),
        ("D", Reason.MAX_NUM_SEQS),
    ]


def test_preempted_by_another_request_and_no_admission_step() -> None:
    s = make_sched(num_gpu_blocks=7, max_model_len=64)
    s.add_request(make_req("A", 8))
    s.add_request(make_req("B", 8))
    for _ in range(5):
        run_step(s)
    s.add_request(make_req("C", 4))
    out, _ = run_step(s)
    assert entries(out) == [
        ("B", Reason.PREEMPTED),
        ("A", Reason.SCHEDULED),
        ("B", Reason.PREEMPTION_STEP),
        ("C", Reason.PREEMPTION_STEP),
    ]
    assert out.trace is not None
    preempted = out.trace.entries[0]
    assert preempted.detail == "by A: KV blocks short for 1 more tokens"
    assert preempted.text() == "B: preempted (by A: KV blocks short for 1 more tokens)"


def test_preempted_by_itself() -> None:
    s = make_sched(num_gpu_blocks=8, max_model_len=64)
    s.add_request(make_req("A", 8))
    s.add_request(make_req("B", 8))
    for _ in range(5):
        run_step(s)
    out, _ = run_step(s)
    assert entries(out)[:2] == [("A", Reason.SCHEDULED), ("B", Reason.PREEMPTED)]
    assert out.trace is not None
    assert out.trace.entries[1].detail.startswith("by itself")


def test_victim_scheduled_earlier_in_the_step_loses_its_scheduled_entry() -> None:
    s = make_sched(
        num_gpu_blocks=11,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        policy="priority",
        long_prefill_token_threshold=8,
    )
    s.add_request(make_req("B", 40, max_tokens=1, priority=5, arrival_time=1.0))
    run_step(s)
    s.add_request(make_req("A", 4, max_tokens=8, priority=0, arrival_time=2.0))
    s.add_request(make_req("D", 12, max_tokens=8, priority=1, arrival_time=3.0))
    run_step(s)
    out, _ = run_step(s)
    assert entries(out) == [
        ("B", Reason.PREEMPTED),
        ("A", Reason.SCHEDULED),
        ("D", Reason.SCHEDULED),
        ("B", Reason.PREEMPTION_STEP),
    ]
    assert out.trace is not None
    assert sum(e.num_tokens for e in out.trace.entries) == out.total_num_scheduled_tokens


def test_admission_gate() -> None:
    s = make_sched()
    calls: list[Scheduler] = []

    def gate(sched: Scheduler) -> str | None:
        calls.append(sched)
        return "rank 1 is at max_num_seqs" if len(calls) == 1 else None

    s.admission_gate = gate
    s.add_request(make_req("A", 4))
    s.add_request(make_req("B", 4))
    out, _ = run_step(s)
    assert out.scheduled == []
    assert entries(out) == [("A", Reason.ADMISSION_GATED), ("B", Reason.ADMISSION_GATED)]
    assert entry(out, "B").detail == "rank 1 is at max_num_seqs"
    assert calls == [s]
    out, _ = run_step(s)
    assert out.num_scheduled_tokens_by_id() == {"A": 4, "B": 4}
    # Nothing waits: the gate is not consulted.
    run_step(s)
    assert len(calls) == 2


def test_admission_gate_does_not_stop_running_requests() -> None:
    s = make_sched()
    s.add_request(make_req("A", 4))
    run_step(s)
    s.admission_gate = lambda sched: "held back"
    s.add_request(make_req("B", 4))
    out, _ = run_step(s)
    assert entries(out) == [("A", Reason.SCHEDULED), ("B", Reason.ADMISSION_GATED)]
    assert out.num_scheduled_tokens_by_id() == {"A": 1}


def test_admission_gate_works_without_tracing() -> None:
    s = make_sched(trace=False)
    s.admission_gate = lambda sched: "held back"
    s.add_request(make_req("A", 4))
    out, _ = run_step(s)
    assert out.scheduled == [] and out.trace is None
    assert len(s.waiting) == 1


def test_gate_with_its_own_reason() -> None:
    class BalanceGate:
        reason = Reason.BALANCE_GATE

        def __call__(self, sched: Scheduler) -> str | None:
            return "rank 2 runs 32 of max_num_seqs 32"

    s = make_sched()
    s.admission_gate = BalanceGate()
    s.add_request(make_req("A", 4))
    s.add_request(make_req("B", 4))
    out, _ = run_step(s)
    assert entries(out) == [("A", Reason.BALANCE_GATE), ("B", Reason.BALANCE_GATE)]
    assert entry(out, "A").detail == "rank 2 runs 32 of max_num_seqs 32"


def test_prefill_cadence_reason() -> None:
    s = make_sched(prefill_schedule_interval=2)
    s.add_request(make_req("A", 4))
    run_step(s)
    s.add_request(make_req("B", 4))
    out, _ = run_step(s)
    assert entries(out) == [("A", Reason.SCHEDULED), ("B", Reason.PREFILL_DEFERRED)]


def test_async_max_tokens_in_flight_reason() -> None:
    s = make_sched(async_scheduling=True)
    p = Pipeline(s)
    s.add_request(make_req("A", 4, max_tokens=1))
    p.schedule()
    out = p.schedule()
    assert entries(out) == [("A", Reason.MAX_TOKENS_IN_FLIGHT)]
    assert entry(out, "A").detail == "1 in flight"


def test_async_output_in_flight_reason() -> None:
    s = make_sched(async_scheduling=True, num_gpu_blocks=4, scheduler_reserve_full_isl=False)
    p = Pipeline(s)
    s.add_request(make_req("A", 8, max_tokens=4))
    s.add_request(make_req("B", 3, max_tokens=3))
    p.schedule()
    assert [r.request_id for r in p.schedule().preempted] == ["B"]
    # Planned before the step holding B's prefill returned (a 3-deep pipeline).
    out = p.schedule()
    assert ("B", Reason.OUTPUT_IN_FLIGHT) in entries(out)


def test_grammar_compiling_reason() -> None:
    class Compiling:
        ready = False

    s = make_sched()
    s.add_request(make_req("G", 4, grammar=Compiling()))
    s.add_request(make_req("A", 4))
    out, _ = run_step(s)
    assert entries(out) == [("G", Reason.GRAMMAR_COMPILING), ("A", Reason.SCHEDULED)]


def test_mamba_alignment_reason() -> None:
    # Hybrid model, prefix caching on: chunks end on 4-token block boundaries.
    s = make_sched(mamba=True, max_num_batched_tokens=10, max_num_seqs=2)
    s.add_request(make_req("A", 40))
    s.add_request(make_req("B", 40))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens_by_id() == {"A": 8}
    assert entries(out) == [("A", Reason.SCHEDULED), ("B", Reason.MAMBA_ALIGNMENT)]
    assert entry(out, "B").detail == "2 tokens left"


def test_session_waiting_for_input_reason() -> None:
    s = make_sched()
    s.add_request(make_req("S", 4, max_tokens=1, resumable=True))
    run_step(s)
    s.add_request(make_req("A", 4))
    out, _ = run_step(s)
    assert entries(out) == [("S", Reason.WAITING_FOR_INPUT), ("A", Reason.SCHEDULED)]


def test_every_reason_has_a_scenario() -> None:
    # Guards this file: a new Reason needs a scenario above (the KV-connector
    # ones have theirs in test_remote_kv.py, the policies' in core/policies/,
    # encoder_input_held in test_scheduler_multimodal.py).
    assert {r.value for r in Reason} == {
        "scheduled",
        "nothing_to_compute",
        "max_tokens_in_flight",
        "output_in_flight",
        "token_budget_spent",
        "grammar_compiling",
        "max_num_seqs_reached",
        "kv_blocks_short",
        "watermark",
        "prompt_exceeds_budget_unchunked",
        "lora_slots_full",
        "preempted",
        "no_admission_in_preempting_step",
        "queued_behind",
        "admission_gated",
        "prefill_deferred",
        "dp_balance_gate",
        "waiting_for_remote_kv",
        "kv_load_failed_recomputing",
        "blocks_held_while_sending",
        "skipped_no_room",
        "preempted_for_waiting_priority",
        "held_for_fair_share",
        "declined_for_deadline",
        "held_by_policy",
        "mamba_block_alignment",
        "session_waiting_for_input",
        "encoder_input_held",
    }


# ---- listing cap -------------------------------------------------------------------------


def test_waiting_list_is_capped_and_the_rest_counted() -> None:
    s = make_sched(max_num_seqs=1, num_gpu_blocks=2048, max_num_batched_tokens=64)
    total = MAX_LISTED_WAITING + 20
    for k in range(total):
        s.add_request(make_req(f"r{k}", 4))
    out, _ = run_step(s)
    assert out.trace is not None
    reasons = [e.reason for e in out.trace.entries]
    assert reasons[0] is Reason.SCHEDULED
    assert reasons[1] is Reason.MAX_NUM_SEQS
    assert reasons[2:] == [Reason.QUEUED] * MAX_LISTED_WAITING
    # One ran, one head, MAX_LISTED_WAITING listed: the rest only counted.
    assert out.trace.num_unlisted_waiting == total - 2 - MAX_LISTED_WAITING
    assert out.trace.to_json()["unlisted_waiting"] == total - 2 - MAX_LISTED_WAITING
    assert out.trace.explain().endswith(f"  ... and {total - 2 - MAX_LISTED_WAITING} more waiting")


def test_waiting_list_cap_applies_to_gated_steps() -> None:
    s = make_sched()
    s.admission_gate = lambda sched: "held back"
    total = MAX_LISTED_WAITING + 5
    for k in range(total):
        s.add_request(make_req(f"r{k}", 4))
    out, _ = run_step(s)
    assert out.trace is not None
    assert len(out.trace.entries) == 1 + MAX_LISTED_WAITING
    assert all(e.reason is Reason.ADMISSION_GATED for e in out.trace.entries)
    assert out.trace.num_unlisted_waiting == total - 1 - MAX_LISTED_WAITING


def test_short_waiting_list_has_no_unlisted_count() -> None:
    s = make_sched(max_num_seqs=1)
    for rid in "ABC":
        s.add_request(make_req(rid, 4))
    out, _ = run_step(s)
    assert out.trace is not None
    assert out.trace.num_unlisted_waiting == 0
    assert "unlisted_waiting" not in out.trace.to_json()
    assert "more waiting" not in out.trace.explain()


# ---- shapes ------------------------------------------------------------------------------


def test_to_json_shape() -> None:
    s = make_sched(max_num_batched_tokens=16)
    for rid in "ABC":
        s.add_request(make_req(rid, 10))
    out, _ = run_step(s)
    assert out.trace is not None
    doc = out.trace.to_json()
    assert doc == {
        "entries": [
            ["A", 10, "scheduled", "admitted, prefill 0-10 of 10"],
            ["B", 6, "scheduled", "admitted, prefill 0-6 of 10, capped by the token budget"],
            ["C", 0, "token_budget_spent", "all 16 tokens of the step are used"],
        ]
    }
    assert json.loads(json.dumps(doc)) == doc


def test_explain_shape() -> None:
    s = make_sched(max_num_batched_tokens=16)
    for rid in "ABC":
        s.add_request(make_req(rid, 10))
    out, _ = run_step(s)
    assert out.trace is not None
    assert out.trace.explain().splitlines() == [
        "step 0: 2 requests ran 16 tokens",
        "  A: ran 10 tokens (admitted, prefill 0-10 of 10)",
        "  B: ran 6 tokens (admitted, prefill 0-6 of 10, capped by the token budget)",
        "  C: token budget spent (all 16 tokens of the step are used)",
    ]


def test_explain_singular_and_empty_forms() -> None:
    t = StepTrace(3)
    t.add("x", Reason.SCHEDULED, 1, "decode")
    assert t.explain() == "step 3: 1 request ran 1 tokens\n  x: ran 1 token (decode)"
    empty = StepTrace(4)
    assert empty.explain() == "step 4: 0 requests ran 0 tokens"
    assert empty.to_json() == {"entries": []}


def test_entry_text_without_detail() -> None:
    assert TraceEntry("q", Reason.QUEUED).text() == "q: still queued"
    assert TraceEntry("q", Reason.QUEUED).to_json() == ["q", 0, "queued_behind", ""]


def test_reason_of_returns_the_last_entry() -> None:
    t = StepTrace(0)
    t.add("a", Reason.PREEMPTED, detail="by b")
    t.add("b", Reason.SCHEDULED, 2)
    t.add("a", Reason.PREEMPTION_STEP)
    e = t.reason_of("a")
    assert e is not None and e.reason is Reason.PREEMPTION_STEP
    assert t.reason_of("zzz") is None


def test_reasons_are_strings_for_json() -> None:
    assert json.dumps(Reason.WATERMARK) == '"watermark"'
    assert Reason("kv_blocks_short") is Reason.KV_SHORT
