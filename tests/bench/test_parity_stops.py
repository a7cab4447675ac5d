"""Scripted EOS and stop-token finishes (eos_at, stop_at) replay with vLLM 0.33's decisions."""

from __future__ import annotations

import pytest

from llmsched.bench.parity import compare, load_trace
from llmsched.bench.workload import parse_workload
from llmsched.core.errors import ConfigError
from llmsched.core.output import SchedulerOutput
from llmsched.core.request import Request
from llmsched.executor.replay import ReplayExecutor
from support.scripted_parity import ScriptedSet, assert_matches_vllm, replay_records

SET = ScriptedSet("parity_stops")
DATA = SET.data
NAMES = SET.names
workload = SET.workload
run = replay_records


def test_both_workloads_present_in_both_modes():
    assert NAMES == ["a_e1_eos_preemption", "a_e2_eos_prefix", "e1_eos_preemption", "e2_eos_prefix"]
    for n in NAMES:
        assert bool(workload(n)["config"].get("async_scheduling")) is n.startswith("a_")


@pytest.mark.parametrize("name", NAMES)
def test_decisions_and_bookkeeping_match_vllm(name):
    """Batches, admissions, preemptions and finishes in vLLM's order, block ids, and counts, every step."""
    assert_matches_vllm(run(workload(name)), SET.reference(name), name)


@pytest.mark.parametrize("name", NAMES)
def test_scripted_finishes_change_the_run(name):
    """The scripts matter: without them the replay no longer makes vLLM's decisions."""
    w = workload(name)
    scripted = [r for r in w["requests"] if "eos_at" in r or "stop_at" in r]
    assert any("eos_at" in r for r in scripted) and any("stop_at" in r for r in scripted)
    unscripted = [{k: v for k, v in r.items() if k not in ("eos_at", "stop_at")} for r in w["requests"]]
    plain = {**w, "requests": unscripted}
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    assert compare(run(plain), ref) != []


@pytest.mark.parametrize("name", ["e1_eos_preemption", "a_e1_eos_preemption"])
def test_scripted_finish_counts_on_after_preemption(name):
    """A request preempted before its scripted sample still stops at it (the count does not restart)."""
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    preempted = {rid for s in ref for rid in s["preempted"]}
    scripted = {r["id"] for r in workload(name)["requests"] if "eos_at" in r or "stop_at" in r}
    assert preempted & scripted
    assert compare(run(workload(name), debug=True), ref) == []


def _executor_samples(ex: ReplayExecutor, req: Request, chunks: list[bool]) -> list[tuple]:
    out = []
    for is_chunk in chunks:
        req.is_prefill_chunk = is_chunk
        so = SchedulerOutput(step=0, scheduled=[req], num_scheduled_tokens=[1])
        out.append(ex.execute(so).sampled_token_ids[0])
    return out


def test_executor_counts_samples_not_chunks():
    """The k-th sample returned gets the scripted token; partial chunks sample and count nothing."""
    ex = ReplayExecutor(7, token_at={"a": {2: 2, 4: 5}})
    got = _executor_samples(ex, Request("a", [1, 2, 3]), [True, False, True, False, False, False])
    assert got == [(), (7,), (), (2,), (7,), (5,)]
    assert _executor_samples(ex, Request("b", [1]), [False, False]) == [(7,), (7,)]


def test_eos_and_stop_requests_get_their_sampling_params():
    """eos_at: EOS 2 not ignored; stop_at: stop token 5, EOS still ignored."""
    w = {
        "config": {},
        "requests": [
            {"id": "e", "prompt_len": 4, "max_tokens": 8, "eos_at": 3},
            {"id": "s", "prompt_len": 4, "max_tokens": 8, "stop_at": 2},
            {"id": "n", "prompt_len": 4, "max_tokens": 8},
        ],
    }
    steps = run(w)
    finished = [rid for s in steps for rid in s["finished"]]
    # s stops after its 2nd sample, e after its 3rd, n runs to max_tokens.
    assert finished == ["s", "e", "n"]
    assert [s["step"] for s in steps if s["finished"]] == [1, 2, 7]


@pytest.mark.parametrize("bad", [0, -1, "3", 2.5, True])
def test_bad_scripted_finish_is_refused_by_name(bad):
    w = {"config": {}, "requests": [{"id": "x", "prompt_len": 4, "max_tokens": 8, "eos_at": bad}]}
    with pytest.raises(ConfigError, match="'x': eos_at must be an integer >= 1"):
        parse_workload(w)
