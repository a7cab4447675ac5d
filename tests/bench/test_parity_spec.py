"""Scripted speculative decoding (spec) replays with vLLM 0.33's decisions, sync and async."""

from __future__ import annotations

import pytest

from llmsched.bench.parity import compare, load_trace
from llmsched.bench.workload import parse_workload
from llmsched.core.errors import ConfigError
from llmsched.core.output import SchedulerOutput
from llmsched.core.request import Request
from llmsched.executor.replay import ReplayExecutor
from support.scripted_parity import ScriptedSet, assert_matches_vllm, replay_records

SET = ScriptedSet("parity_spec")
DATA = SET.data
NAMES = SET.names
workload = SET.workload
run = replay_records


def test_both_workloads_present_in_both_modes():
    assert NAMES == [
        "a_s1_spec_preemption",
        "a_s2_spec_prefix_priority",
        "a_s3_spec_tight_cache",
        "a_s4_spec_default_cache",
        "s1_spec_preemption",
        "s2_spec_prefix_priority",
        "s3_spec_tight_cache",
        "s4_spec_default_cache",
    ]
    for n in NAMES:
        assert bool(workload(n)["config"].get("async_scheduling")) is n.startswith("a_")


@pytest.mark.parametrize("name", NAMES)
def test_decisions_and_bookkeeping_match_vllm(name):
    """Batches with their draft counts, admissions, preemptions, finishes, block ids, counts: every step."""
    assert_matches_vllm(run(workload(name), debug=True), SET.reference(name), name, extra_keys=("drafts",))


@pytest.mark.parametrize("name", [n for n in NAMES if "s1_" in n or "s2_" in n])
def test_the_traces_cover_what_they_are_for(name):
    """Drafts are verified, preemptions happen, and scripted stops land in steps that verified drafts."""
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    w = workload(name)
    stopping = {r["id"] for r in w["requests"] if "eos_at" in r or "stop_at" in r}
    assert sum(len(s["drafts"]) for s in ref) > 100
    assert any(s["preempted"] for s in ref)
    assert any(rid in s["drafts"] for s in ref for rid in s["finished"] if rid in stopping)


@pytest.mark.parametrize("name", [n for n in NAMES if "s3_" in n or "s4_" in n])
def test_drafts_past_a_full_cache_preempt_and_the_request_still_finishes(name):
    """Full lengths that fill the cache, drafts past them: vLLM runs every request (llmsched once refused)."""
    w = workload(name)
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    cfg = parse_workload(w).scheduler_config()
    bs, usable, k = cfg.block_size, cfg.num_gpu_blocks - 1, cfg.num_speculative_tokens
    full = [min(r["prompt_len"] + r["max_tokens"], cfg.max_model_len) - 1 for r in w["requests"]]
    assert all(-(-n // bs) <= usable for n in full)
    assert any(-(-(n + k) // bs) > usable for n in full)
    assert sorted(rid for s in ref for rid in s["finished"]) == sorted(r["id"] for r in w["requests"])
    assert any(s["preempted"] for s in ref)
    assert sum(len(s["drafts"]) for s in ref) >= 5


@pytest.mark.parametrize("name", ["s2_spec_prefix_priority", "a_s2_spec_prefix_priority"])
def test_one_token_admissions_are_padded_to_a_draft_step(name):
    """A full prefix hit leaves one token; vLLM admits it with num_speculative_tokens placeholder drafts."""
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    k = workload(name)["config"]["num_speculative_tokens"]
    padded = [(s["step"], a[0]) for s in ref for a in s["admitted"] if a[0] in s["drafts"]]
    assert padded
    for step, rid in padded:
        s = next(s for s in ref if s["step"] == step)
        assert s["drafts"][rid] == k and dict(map(tuple, s["sched"]))[rid] == 1 + k


@pytest.mark.parametrize("name", ["s1_spec_preemption", "a_s1_spec_preemption"])
def test_the_scripts_change_the_run(name):
    """Without the draft scripts, or with every draft rejected, the replay makes other decisions than vLLM."""
    w = workload(name)
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    bare = {**w, "requests": [{k: v for k, v in r.items() if k != "spec"} for r in w["requests"]]}
    assert compare(run(bare), ref) != []
    rejected = [{**r, "spec": [[d, 0] for d, _ in r["spec"]]} if "spec" in r else r for r in w["requests"]]
    assert compare(run({**w, "requests": rejected}), ref) != []


def _step(ex: ReplayExecutor, req: Request, drafts: list[int], admitted: bool = False):
    req.is_prefill_chunk = False
    so = SchedulerOutput(step=0, scheduled=[req], num_scheduled_tokens=[1 + len(drafts)])
    if drafts:
        so.spec_decode_tokens[req.request_id] = drafts
    if admitted:
        so.admitted.append(req)
    res = ex.execute(so)
    return tuple(res.sampled_token_ids[0]), list(res.draft_token_ids[0])


def test_executor_accepts_at_most_what_was_verified_and_offered():
    """Accepted = min(scripted, drafts verified, drafts offered after the previous sample)."""
    ex = ReplayExecutor(7, spec={"a": [(2, 0), (3, 5), (4, 1), (1, 3)]})
    a = Request("a", [1, 2, 3])
    assert _step(ex, a, []) == ((7,), [7, 7])
    # Scripted 5, verified 2, offered 2: two accepted.
    assert _step(ex, a, [7, 7]) == ((7, 7, 7), [7, 7, 7])
    assert _step(ex, a, [7, 7, 7]) == ((7, 7), [7, 7, 7, 7])
    # Scripted 3, verified 1.
    assert _step(ex, a, [7]) == ((7, 7), [7])
    # Past the script: nothing accepted, nothing offered.
    assert _step(ex, a, [7]) == ((7,), [])


def test_executor_never_accepts_an_admissions_padding():
    ex = ReplayExecutor(7, spec={"a": [(3, 3), (3, 3)]})
    a = Request("a", [1, 2, 3])
    assert _step(ex, a, []) == ((7,), [7, 7, 7])
    assert _step(ex, a, [-1, -1, -1], admitted=True) == ((7,), [7, 7, 7])


def test_scripted_finish_counts_tokens_across_accepted_drafts():
    """eos_at counts returned tokens: an EOS among accepted drafts ends the request there."""
    ex = ReplayExecutor(7, token_at={"a": {4: 2}}, spec={"a": [(3, 0), (3, 3)]})
    a = Request("a", [1, 2, 3])
    assert _step(ex, a, [])[0] == (7,)
    assert _step(ex, a, [7, 7, 7])[0] == (7, 7, 2, 7)
    w = {
        "config": {"num_speculative_tokens": 3},
        "requests": [{"id": "e", "prompt_len": 4, "max_tokens": 20, "eos_at": 4, "spec": [[3, 0], [3, 3]]}],
    }
    steps = run(w)
    assert [s["finished"] for s in steps if s["finished"]] == [["e"]]
    assert [s["sched"] for s in steps if s["total_tokens"]] == [[["e", 4]], [["e", 4]]]


@pytest.mark.parametrize(
    ("spec", "config", "match"),
    [
        ([[1, 1]], {}, "'x' has 'spec' but the workload config has no num_speculative_tokens"),
        ([[4, 1]], {"num_speculative_tokens": 3}, "'x': spec entry #1 is \\[4, 1\\]"),
        ([[1, -1]], {"num_speculative_tokens": 3}, "'x': spec entry #1"),
        ([[1, 1], [2]], {"num_speculative_tokens": 3}, "'x': spec entry #2"),
        ([[True, 1]], {"num_speculative_tokens": 3}, "'x': spec entry #1"),
        ({"1": 1}, {"num_speculative_tokens": 3}, "'x': 'spec' must be a list"),
    ],
)
def test_bad_spec_script_is_refused_by_name(spec, config, match):
    w = {"config": config, "requests": [{"id": "x", "prompt_len": 4, "max_tokens": 8, "spec": spec}]}
    with pytest.raises(ConfigError, match=match):
        parse_workload(w)
