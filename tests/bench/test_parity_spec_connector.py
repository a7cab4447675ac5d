"""Speculative decoding with a scripted KV connector replays with vLLM 0.33's decisions, sync and async."""

from __future__ import annotations

import pytest

from support.scripted_parity import ScriptedSet, assert_matches_vllm, replay_records

SET = ScriptedSet("parity_spec_connector")
DATA = SET.data
NAMES = SET.names
workload = SET.workload


def run(w: dict) -> list[dict]:
    return replay_records(w, debug=True)


def padded_after_sync_load(steps: list[dict], k: int) -> list[tuple[int, str]]:
    """(step, request) of admissions padded to 1 + k tokens right after a sync KV load."""
    return [
        (s["step"], rid)
        for s in steps
        for rid, _, load_async in (tuple(x) for x in s.get("kv_loads") or ())
        if not load_async and s["drafts"].get(rid) == k and dict(map(tuple, s["sched"])).get(rid) == 1 + k
    ]


def test_workloads_present_in_both_modes():
    assert NAMES == [
        "a_s1_spec_kv_both",
        "a_s2_padded_load_fails",
        "a_s3_async_load_draft_room",
        "s1_spec_kv_both",
        "s2_padded_load_fails",
        "s3_async_load_draft_room",
    ]
    for n in NAMES:
        cfg = workload(n)["config"]
        assert bool(cfg.get("async_scheduling")) is n.startswith("a_")
        assert cfg["kv_connector"] and cfg["num_speculative_tokens"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_decisions_and_bookkeeping_match_vllm(name):
    """Batches with their drafts, admissions, loads, finishes, block ids, counts: every step."""
    assert_matches_vllm(run(workload(name)), SET.reference(name), name, extra_keys=("drafts",))


@pytest.mark.parametrize("name", [n for n in NAMES if "_s1_" in f"_{n}" or "_s2_" in f"_{n}"])
def test_a_padded_admission_after_a_sync_load_whose_blocks_fail(name):
    """vLLM pads the one token a sync load leaves to a full draft step, and that load fails."""
    ref = SET.reference(name)
    padded = padded_after_sync_load(ref, workload(name)["config"]["num_speculative_tokens"])
    assert padded
    step = {s["step"]: s for s in ref}
    failed = [
        (at, rid)
        for at, rid in padded
        if set(step[at]["blocks"].get(rid, ())) & set(step[at].get("kv_out", {}).get("invalid", ()))
    ]
    assert failed


@pytest.mark.parametrize("name", ["s3_async_load_draft_room", "a_s3_async_load_draft_room"])
def test_async_loads_start_while_drafts_run(name):
    """Async loads start in a tight cache beside requests verifying drafts (room is kept for a draft step)."""
    ref = SET.reference(name)
    assert any(is_async for s in ref for _, _, is_async in s.get("kv_loads") or ())
    assert sum(len(s["drafts"]) for s in ref) > 10
