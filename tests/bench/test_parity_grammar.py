"""Scripted grammar waits (grammar_steps) replay with vLLM 0.33's decisions, sync and async."""

from __future__ import annotations

import pytest

from llmsched.bench.parity import compare, decisions, load_trace
from llmsched.bench.workload import parse_workload
from llmsched.core.errors import ConfigError
from support.scripted_parity import ScriptedSet, assert_matches_vllm, replay_records

SET = ScriptedSet("parity_grammar")
DATA = SET.data
NAMES = SET.names
workload = SET.workload
run = replay_records


def test_both_workloads_present_in_both_modes():
    assert NAMES == ["a_g1_grammar_fcfs", "a_g2_grammar_priority", "g1_grammar_fcfs", "g2_grammar_priority"]
    for n in NAMES:
        assert bool(workload(n)["config"].get("async_scheduling")) is n.startswith("a_")


@pytest.mark.parametrize("name", NAMES)
def test_decisions_and_bookkeeping_match_vllm(name):
    """Batches, admissions, preemptions, finishes, block ids and counts, every step (empty ones too)."""
    assert_matches_vllm(run(workload(name), debug=True), SET.reference(name), name)


@pytest.mark.parametrize("name", NAMES)
def test_requests_behind_a_compiling_grammar_go_first(name):
    """The traces cover the rule: a request queued behind one whose grammar compiles is admitted before it."""
    w = workload(name)
    order = {r["id"]: i for i, r in enumerate(w["requests"])}
    due = {r["id"]: r["arrival_step"] + r["grammar_steps"] for r in w["requests"] if r.get("grammar_steps")}
    admitted: dict[str, int] = {}
    for s in load_trace(DATA / f"{name}.vllm.jsonl"):
        for rid, *_ in s["admitted"]:
            admitted.setdefault(rid, s["step"])
    overtaken = [g for g in due if any(order[o] > order[g] and admitted[o] < due[g] for o in admitted)]
    assert overtaken
    for g in due:
        assert admitted[g] >= due[g]


@pytest.mark.parametrize("name", ["g2_grammar_priority", "a_g2_grammar_priority"])
def test_the_waits_change_the_run(name):
    """Without the grammar waits (or with every grammar ready at once) the replay decides otherwise."""
    w = workload(name)
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    bare = {**w, "requests": [{k: v for k, v in r.items() if k != "grammar_steps"} for r in w["requests"]]}
    assert compare(run(bare), ref) != []
    ready = [{**r, "grammar_steps": 0} if "grammar_steps" in r else r for r in w["requests"]]
    assert compare(run({**w, "requests": ready}), ref) != []


def test_a_ready_grammar_changes_nothing():
    """grammar_steps 0: compiled on arrival, the request runs as if it had no grammar."""
    w = {"config": {}, "requests": [{"id": "a", "prompt_len": 20, "max_tokens": 4}]}
    g = {"config": {}, "requests": [{"id": "a", "prompt_len": 20, "max_tokens": 4, "grammar_steps": 0}]}
    assert decisions(run(w)) == decisions(run(g))
    late = {"config": {}, "requests": [{"id": "a", "prompt_len": 20, "max_tokens": 4, "grammar_steps": 3}]}
    steps = run(late)
    assert [s["total_tokens"] for s in steps[:4]] == [0, 0, 0, 20]


@pytest.mark.parametrize("bad", [-1, "2", 1.5, True])
def test_bad_grammar_steps_is_refused_by_name(bad):
    w = {"config": {}, "requests": [{"id": "x", "prompt_len": 4, "max_tokens": 8, "grammar_steps": bad}]}
    with pytest.raises(ConfigError, match="'x': grammar_steps must be an integer >= 0"):
        parse_workload(w)
