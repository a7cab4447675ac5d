"""Multimodal workloads replay with vLLM's decisions, encoder inputs and encoder-cache evictions included."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest

from llmsched.bench.parity import compare, decisions, load_trace
from llmsched.bench.replay import replay
from llmsched.bench.workload import load_workload, parse_workload

DATA = Path(__file__).resolve().parents[1] / "data"
# parity_seed001/: the reference workloads (random ones recorded with vLLM
# 0.33 are in the fuzz corpus, tests/data/parity_fuzz/corpus-multimodal).
CASES = sorted(
    str(p.relative_to(DATA)).removesuffix(".workload.json")
    for d in ("parity_seed001",)
    for p in (DATA / d).glob("*.workload.json")
    if load_workload(p).has_mm
)


def run(workload, **overrides) -> list[dict]:
    buf = io.StringIO()
    replay(workload, buf, **overrides)
    return [json.loads(line) for line in buf.getvalue().splitlines()[1:]]


def test_reference_workloads_present():
    assert "parity_seed001/m1_multimodal" in CASES and "parity_seed001/a_m1_multimodal" in CASES
    assert load_workload(DATA / "parity_seed001/a_m1_multimodal.workload.json").config["async_scheduling"]


@pytest.mark.parametrize("case", CASES)
def test_decisions_match_vllm(case):
    ours = run(load_workload(DATA / f"{case}.workload.json"), debug=True)
    ref = load_trace(DATA / f"{case}.vllm.jsonl")
    assert compare(ours, ref) == []
    assert len(decisions(ours)) == len(decisions(ref)) > 0
    # Not vacuous: images were encoded, and the step records carry them.
    assert any(s["enc"] for s in ref)
    for a, b in zip(ours, ref):
        for key in ("step", "total_tokens", "num_running", "num_waiting", "kv_usage", "enc", "enc_freed"):
            assert a[key] == b[key], (case, a["step"], key)
        assert a["admitted"] == b["admitted"], (case, a["step"])


def test_every_step_reports_encoder_fields_even_before_the_first_image():
    raw = copy.deepcopy(_raw("parity_seed001/m1_multimodal"))
    for r in raw["requests"]:
        r["arrival_step"] += 40 if r.get("mm") else 0
    ours = run(parse_workload(raw))
    assert all("enc" in s and "enc_freed" in s for s in ours)
    assert not ours[0]["enc"]


def test_reference_workload_exercises_eviction_and_sharing():
    ref = load_trace(DATA / "parity_seed001/m1_multimodal.vllm.jsonl")
    assert any(s["enc_freed"] for s in ref)
    w = load_workload(DATA / "parity_seed001/m1_multimodal.workload.json")
    ids = [m.identifier for r in w.requests for m in r.mm]
    assert len(ids) > len(set(ids))


def _raw(case: str) -> dict:
    return json.loads((DATA / f"{case}.workload.json").read_text())


def test_a_changed_image_id_changes_decisions():
    """The parity check sees the encoder side: renaming one shared image changes the record."""
    raw = copy.deepcopy(_raw("parity_seed001/m1_multimodal"))
    for r in raw["requests"]:
        for m in r.get("mm") or ():
            if m["id"] == "img1":
                m["id"] = "img1-other"
    ours = run(parse_workload(raw))
    ref = load_trace(DATA / "parity_seed001/m1_multimodal.vllm.jsonl")
    assert compare(ours, ref) != []


def test_without_images_the_workload_schedules_differently():
    raw = copy.deepcopy(_raw("parity_seed001/m1_multimodal"))
    for r in raw["requests"]:
        r.pop("mm", None)
    ours = run(parse_workload(raw))
    assert "enc" not in ours[0]
    ref = load_trace(DATA / "parity_seed001/m1_multimodal.vllm.jsonl")
    assert [s["sched"] for s in ours if s["total_tokens"]] != [s["sched"] for s in ref if s["total_tokens"]]
