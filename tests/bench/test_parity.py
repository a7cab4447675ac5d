"""The recorded vLLM traces replay with identical decisions."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from llmsched.bench.parity import compare, decisions, load_trace
from llmsched.bench.replay import replay
from llmsched.bench.workload import load_workload

DATA = Path(__file__).resolve().parents[1] / "data" / "parity"
NAMES = sorted(p.name.removesuffix(".workload.json") for p in DATA.glob("*.workload.json"))


def run(name: str, **overrides) -> list[dict]:
    buf = io.StringIO()
    replay(load_workload(DATA / f"{name}.workload.json"), buf, **overrides)
    return [json.loads(line) for line in buf.getvalue().splitlines()[1:]]


def test_all_four_workloads_present():
    assert NAMES == ["p1_first_batch", "p2_preemption", "p3_prefix_sharing", "p4_priority"]


@pytest.mark.parametrize("name", NAMES)
def test_decisions_match_vllm(name):
    ours = run(name)
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    assert compare(ours, ref) == []
    # The comparison is not vacuous: every recorded decision was checked.
    assert len(decisions(ours)) == len(decisions(ref)) > 0


@pytest.mark.parametrize("name", NAMES)
def test_bookkeeping_matches_vllm(name):
    """Beyond decisions: queue sizes, KV usage and prefix hits after every schedule()."""
    ours = run(name)
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        for key in ("step", "total_tokens", "num_running", "num_waiting", "kv_usage", "finished"):
            assert a[key] == b[key], (name, a["step"], key)
        assert sorted(map(tuple, a["admitted"])) == sorted(map(tuple, b["admitted"])), (name, a["step"])


@pytest.mark.parametrize("name", ["p2_preemption", "p4_priority"])
def test_decisions_match_with_debug_invariants(name):
    """Same decisions with every invariant asserted after every step."""
    ref = load_trace(DATA / f"{name}.vllm.jsonl")
    assert compare(run(name, debug=True), ref) == []


def test_parity_detects_a_difference():
    ours = run("p1_first_batch")
    ours[1]["sched"] = ours[1]["sched"][::-1]
    diffs = compare(ours, load_trace(DATA / "p1_first_batch.vllm.jsonl"))
    assert diffs and "sched" in diffs[0]
