"""LoRA adapters (lora_id) with max_loras below their number replay with vLLM 0.33's decisions."""

from __future__ import annotations

import pytest

from llmsched.bench.parity import compare, load_trace
from support.scripted_parity import ScriptedSet, assert_matches_vllm, replay_records

SET = ScriptedSet("parity_lora")
DATA = SET.data
NAMES = SET.names
workload = SET.workload
run = replay_records


def test_both_workloads_present_in_both_modes():
    assert NAMES == ["a_l1_lora_fcfs", "a_l2_lora_priority", "l1_lora_fcfs", "l2_lora_priority"]
    for n in NAMES:
        w = workload(n)
        assert bool(w["config"].get("async_scheduling")) is n.startswith("a_")
        adapters = {r["lora_id"] for r in w["requests"] if r.get("lora_id")}
        assert len(adapters) > w["config"]["max_loras"]


@pytest.mark.parametrize("name", NAMES)
def test_decisions_and_bookkeeping_match_vllm(name):
    """Batches, admissions with their prefix hits, preemptions, finishes, block ids and counts, every step."""
    assert_matches_vllm(run(workload(name), debug=True), SET.reference(name), name)


@pytest.mark.parametrize("name", NAMES)
def test_running_adapters_never_exceed_max_loras(name):
    """In the traces: never more adapters running than max_loras, and some request waited for a slot."""
    w = workload(name)
    lora = {r["id"]: r.get("lora_id", 0) for r in w["requests"]}
    order = {r["id"]: i for i, r in enumerate(w["requests"])}
    running: set[str] = set()
    admitted_at: dict[str, int] = {}
    for s in load_trace(DATA / f"{name}.vllm.jsonl"):
        running -= set(s["preempted"])
        for rid, *_ in s["admitted"]:
            running.add(rid)
            admitted_at.setdefault(rid, s["step"])
        assert len({lora[r] for r in running if lora[r]}) <= w["config"]["max_loras"], s["step"]
        running -= set(s["finished"])
    arrival = {r["id"]: r["arrival_step"] for r in w["requests"]}
    # Some adapter request was passed over by a later one.
    assert any(
        lora[a] and order[b] > order[a] and arrival[b] >= arrival[a] and admitted_at[b] < admitted_at[a]
        for a in admitted_at
        for b in admitted_at
    )


@pytest.mark.parametrize("name", ["l1_lora_fcfs", "a_l2_lora_priority"])
def test_the_adapters_change_the_run(name):
    """Without max_loras, or with every request on the base model, the replay decides otherwise."""
    w = workload(name)
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    unlimited = {**w, "config": {**w["config"], "max_loras": None}}
    assert compare(run(unlimited), ref) != []
    base = {**w, "requests": [{k: v for k, v in r.items() if k != "lora_id"} for r in w["requests"]]}
    assert compare(run(base), ref) != []
