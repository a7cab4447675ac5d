"""The recorded vLLM traces replay with identical decisions, sync and async scheduling."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from llmsched.bench.parity import compare, decisions, load_trace, records_blocks
from llmsched.bench.replay import replay
from llmsched.bench.workload import load_workload
from support.traces import events

DATA = Path(__file__).resolve().parents[1] / "data"
# parity/: vLLM's synchronous Scheduler; parity_async/: its AsyncScheduler on
# the same workloads with "async_scheduling": true.
SETS = ("parity", "parity_async")
NAMES = sorted(p.name.removesuffix(".workload.json") for p in (DATA / "parity").glob("*.workload.json"))
CASES = [f"{d}/{n}" for d in SETS for n in NAMES]


def run(case: str, **overrides) -> list[dict]:
    buf = io.StringIO()
    replay(load_workload(DATA / f"{case}.workload.json"), buf, **overrides)
    return [json.loads(line) for line in buf.getvalue().splitlines()[1:]]


def test_all_four_workloads_present_in_both_modes():
    assert NAMES == ["p1_first_batch", "p2_preemption", "p3_prefix_sharing", "p4_priority"]
    for d in SETS:
        assert sorted(p.name for p in (DATA / d).glob("*.workload.json")) == [
            f"{n}.workload.json" for n in NAMES
        ]
    for n in NAMES:
        assert load_workload(DATA / f"parity_async/{n}.workload.json").config["async_scheduling"] is True


@pytest.mark.parametrize("case", CASES)
def test_decisions_match_vllm(case):
    ours = run(case)
    ref = load_trace(DATA / f"{case}.vllm.jsonl")
    assert compare(ours, ref) == []
    # Block ids too: both traces record them.
    assert records_blocks(ours) and records_blocks(ref)
    # The comparison is not vacuous: every recorded decision was checked.
    assert len(decisions(ours)) == len(decisions(ref)) > 0


@pytest.mark.parametrize("case", CASES)
def test_bookkeeping_matches_vllm(case):
    """Beyond decisions: queue sizes, KV usage and prefix hits after every schedule()."""
    ours = run(case)
    ref = load_trace(DATA / f"{case}.vllm.jsonl")
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        for key in ("step", "total_tokens", "num_running", "num_waiting", "kv_usage", "finished"):
            assert a[key] == b[key], (case, a["step"], key)
        assert a["admitted"] == b["admitted"], (case, a["step"])


@pytest.mark.parametrize("case", [f"{d}/{n}" for d in SETS for n in ("p2_preemption", "p4_priority")])
def test_decisions_match_with_debug_invariants(case):
    """Same decisions with every invariant asserted after every step."""
    ref = load_trace(DATA / f"{case}.vllm.jsonl")
    assert compare(run(case, debug=True), ref) == []


@pytest.mark.parametrize("name", NAMES)
def test_async_replay_is_not_the_sync_replay(name):
    """Async mode changes the loop: one more step drains the batch queue."""
    sync_ref = load_trace(DATA / f"parity/{name}.vllm.jsonl")
    async_ref = load_trace(DATA / f"parity_async/{name}.vllm.jsonl")
    assert len(run(f"parity_async/{name}")) == len(async_ref) > len(sync_ref)


@pytest.mark.parametrize("name", ["p2_preemption", "p4_priority"])
def test_async_decisions_differ_from_sync_under_pressure(name):
    """Where KV runs short, vLLM's two modes decide differently; the async replay follows the async one."""
    sync_ref = load_trace(DATA / f"parity/{name}.vllm.jsonl")
    async_ref = load_trace(DATA / f"parity_async/{name}.vllm.jsonl")
    assert decisions(sync_ref) != decisions(async_ref)
    assert compare(run(f"parity_async/{name}"), sync_ref) != []


def test_parity_detects_a_difference():
    ours = run("parity/p1_first_batch")
    ours[1]["sched"] = ours[1]["sched"][::-1]
    diffs = compare(ours, load_trace(DATA / "parity/p1_first_batch.vllm.jsonl"))
    assert diffs and "sched" in diffs[0]


# parity_pd/: a scripted KV connector (disaggregated prefill/decode, offloading),
# each workload also in async mode (a_*).
PD_NAMES = sorted(p.name.removesuffix(".workload.json") for p in (DATA / "parity_pd").glob("*.workload.json"))


def test_all_six_connector_workloads_present():
    base = ["c1_consumer", "o1_offload", "p1_producer"]
    assert sorted(base + [f"a_{n}" for n in base]) == PD_NAMES
    for n in base:
        assert load_workload(DATA / f"parity_pd/a_{n}.workload.json").config["async_scheduling"] is True
        assert load_workload(DATA / f"parity_pd/{n}.workload.json").kv_connector is not None


@pytest.mark.parametrize("name", PD_NAMES)
def test_connector_decisions_match_vllm(name):
    """Decisions and the KV loads started each step, as vLLM made them with the same connector answers."""
    ours = run(f"parity_pd/{name}")
    ref = load_trace(DATA / f"parity_pd/{name}.vllm.jsonl")
    assert compare(ours, ref) == []
    assert len(decisions(ours)) == len(decisions(ref)) > 0
    assert any(s["kv_loads"] for s in ref) or any(s["kv_out"].get("sent") for s in ref)


@pytest.mark.parametrize("name", PD_NAMES)
def test_connector_bookkeeping_matches_vllm(name):
    """Queue sizes (those waiting for remote KV included), KV usage, hits and connector events, every step."""
    ours = run(f"parity_pd/{name}")
    ref = load_trace(DATA / f"parity_pd/{name}.vllm.jsonl")
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        for key in ("step", "total_tokens", "num_running", "num_waiting", "kv_usage", "finished", "kv_loads"):
            assert a[key] == b[key], (name, a["step"], key)
        # Invalid block ids by count: see support.traces.events.
        assert events(a["kv_out"]) == events(b["kv_out"]), (name, a["step"])
        assert a["admitted"] == b["admitted"], (name, a["step"])


@pytest.mark.parametrize("name", ["c1_consumer", "a_c1_consumer", "a_o1_offload"])
def test_connector_decisions_match_with_debug_invariants(name):
    """Same decisions with every invariant (deferred frees counted) asserted after every step."""
    ref = load_trace(DATA / f"parity_pd/{name}.vllm.jsonl")
    assert compare(run(f"parity_pd/{name}", debug=True), ref) == []


def test_parity_detects_a_block_id_or_order_difference():
    """Block ids, and the order of admissions, are compared as vLLM recorded them."""
    ref = load_trace(DATA / "parity/p2_preemption.vllm.jsonl")
    ours = run("parity/p2_preemption")
    assert compare(ours, ref) == []
    k = next(i for i, s in enumerate(ours) if s["blocks"])
    rid = next(iter(ours[k]["blocks"]))
    ours[k]["blocks"][rid] = [*ours[k]["blocks"][rid][::-1], 0]
    assert "blocks" in compare(ours, ref)[0]
    ours = run("parity/p2_preemption")
    k = next(i for i, s in enumerate(ours) if len(s["admitted"]) > 1)
    ours[k]["admitted"] = ours[k]["admitted"][::-1]
    assert "admitted" in compare(ours, ref)[0]
