"""The scripted parity sets under tests/data/parity_<name>/: workloads, vLLM's traces, replay, comparison."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

from llmsched.bench.parity import compare, decisions, load_trace, records_blocks
from llmsched.bench.replay import replay
from llmsched.bench.workload import parse_workload

DATA_ROOT = Path(__file__).resolve().parents[1] / "data"
# Per-step bookkeeping compared beside the decisions, empty steps included.
STEP_KEYS = ("step", "total_tokens", "num_running", "num_waiting", "kv_usage")


class ScriptedSet:
    """One folder of workloads with the traces vLLM 0.33 recorded for them."""

    def __init__(self, folder: str) -> None:
        self.data = DATA_ROOT / folder
        self.names = sorted(p.name.removesuffix(".workload.json") for p in self.data.glob("*.workload.json"))

    def workload(self, name: str) -> dict:
        """The workload as JSON."""
        return json.loads((self.data / f"{name}.workload.json").read_text())

    def reference(self, name: str) -> list[dict]:
        """vLLM's step records (plain or gzipped JSONL)."""
        gz = self.data / f"{name}.vllm.jsonl.gz"
        if gz.exists():
            with gzip.open(gz, "rt") as f:
                return [r for r in map(json.loads, f) if "header" not in r]
        return load_trace(self.data / f"{name}.vllm.jsonl")


def replay_records(w: dict, **overrides) -> list[dict]:
    """Replay a workload through llmsched; its step records without the header."""
    buf = io.StringIO()
    replay(parse_workload(w), buf, **overrides)
    return [json.loads(line) for line in buf.getvalue().splitlines()[1:]]


def assert_matches_vllm(
    ours: list[dict], ref: list[dict], name: str, extra_keys: tuple[str, ...] = ()
) -> None:
    """Decisions, block ids and every step's bookkeeping equal vLLM's."""
    assert records_blocks(ref) and records_blocks(ours)
    assert compare(ours, ref) == []
    assert len(decisions(ours)) == len(decisions(ref)) > 0
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        for key in STEP_KEYS + extra_keys:
            assert a[key] == b[key], (name, a["step"], key)
