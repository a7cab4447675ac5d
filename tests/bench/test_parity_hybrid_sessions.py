"""Hybrid (Mamba) models and streaming-input sessions replay with vLLM 0.33's decisions, sync and async."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest

from llmsched.bench.parity import compare, decisions, load_trace
from llmsched.bench.replay import replay
from llmsched.bench.workload import load_workload, parse_workload

DATA = Path(__file__).resolve().parents[1] / "data"
# parity_seed001/: vLLM's recorded traces (a_*: its AsyncScheduler).
SEED = [f"parity_seed001/{p}{n}" for n in ("k1_mamba", "s1_sessions") for p in ("", "a_")]
CASES = SEED


def run(case: str, **overrides) -> list[dict]:
    buf = io.StringIO()
    replay(load_workload(DATA / f"{case}.workload.json"), buf, **overrides)
    return [json.loads(line) for line in buf.getvalue().splitlines()[1:]]


def test_workloads_use_the_features() -> None:
    """Each recorded workload is a hybrid model or has sessions, in sync and async form."""
    for case in CASES:
        wl = load_workload(DATA / f"{case}.workload.json")
        assert wl.config.get("mamba") or any(r.segments for r in wl.requests), case
        assert bool(wl.config.get("async_scheduling")) == case.split("/")[1].startswith("a_")


@pytest.mark.parametrize("case", CASES)
def test_decisions_and_bookkeeping_match_vllm(case: str) -> None:
    """Same batches, preemptions and finishes; same queue sizes, KV usage and hits after every schedule()."""
    ours = run(case, debug=True)
    ref = load_trace(DATA / f"{case}.vllm.jsonl")
    assert compare(ours, ref) == []
    assert len(decisions(ours)) == len(decisions(ref)) > 0
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        for key in ("step", "total_tokens", "num_running", "num_waiting", "kv_usage", "finished"):
            assert a[key] == b[key], (case, a["step"], key)
        assert a["admitted"] == b["admitted"], (case, a["step"])


def test_fuzz_corpus_has_hybrid_and_session_cases() -> None:
    """Random Mamba and session workloads recorded with vLLM, sync and async (replayed elsewhere)."""
    with gzip.open(DATA / "parity_fuzz" / "corpus-hybrid.jsonl.gz", "rt") as f:
        cases = [rec for rec in map(json.loads, f) if "header" not in rec]
    cfgs = [c["workload"]["config"] for c in cases]
    assert sum(1 for c in cfgs if c.get("mamba")) >= 12
    assert sum(1 for c in cases if any(r.get("segments") for r in c["workload"]["requests"])) >= 12
    assert {bool(c.get("async_scheduling")) for c in cfgs} == {False, True}


def test_mamba_alignment_changes_decisions() -> None:
    """Without the hybrid cache the same workload schedules differently: the test is not vacuous."""
    ref = load_trace(DATA / "parity_seed001/k1_mamba.vllm.jsonl")
    assert compare(run("parity_seed001/k1_mamba", mamba=False), ref) != []


def test_sessions_keep_their_kv() -> None:
    """A resumed session is admitted with everything but its new input already computed."""
    wl = load_workload(DATA / "parity_seed001/s1_sessions.workload.json")
    sessions = {r.request_id for r in wl.requests if r.segments}
    steps = run("parity_seed001/s1_sessions")
    resumes = [a for s in steps for a in s["admitted"] if a[0] in sessions and a[1] > 0]
    assert resumes, "no session resumed with its KV"
    finishes = [rid for s in steps for rid in s["finished"] if rid in sessions]
    # A session reports a finish for each input it answered.
    assert len(finishes) == sum(1 + len(r.segments) for r in wl.requests if r.segments)


def test_trace_names_alignment_and_waiting_sessions() -> None:
    """The explained replay says when alignment or a waiting session holds a request back."""
    wl = parse_workload(
        {
            "config": {"mamba": True, "max_num_batched_tokens": 40, "max_num_seqs": 4},
            "requests": [{"id": str(i), "prompt_len": 100, "max_tokens": 4} for i in range(3)],
        }
    )
    buf = io.StringIO()
    replay(wl, buf, explain=True)
    steps = [json.loads(line) for line in buf.getvalue().splitlines()[1:]]
    # 40 tokens: 32 aligned for one prompt, 8 left that no aligned chunk fits.
    assert steps[0]["sched"] == [["0", 32]]
    assert ["1", 0, "mamba_block_alignment", "8 tokens left"] in steps[0]["why"]["entries"]
    why = [e for s in run("parity_seed001/s1_sessions", explain=True) for e in s["why"]["entries"]]
    assert any(e[2] == "session_waiting_for_input" for e in why)
