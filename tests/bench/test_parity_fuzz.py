"""The differential-fuzzing corpus replays with vLLM 0.33's recorded decisions, step for step.

Cases with ``"async_scheduling": true`` were recorded from vLLM's
AsyncScheduler driven with a 2-deep batch queue, the others from its sync
Scheduler.

Each case in ``tests/data/parity_fuzz/*.jsonl.gz`` is a random workload (a
random knob mix), or a mismatch the fuzzer found, and what vLLM's own V1
scheduler did with it, recorded by ``tools/parity_fuzz.py`` (see the README
next to the corpus). vLLM is not needed here: the recorded steps are the
reference.
"""

from __future__ import annotations

import copy
import gzip
import io
import json
from pathlib import Path

import pytest

from llmsched.bench.parity import compare, decisions, finish_order_is_deterministic
from llmsched.bench.replay import replay
from llmsched.bench.workload import parse_workload
from support.traces import events

CORPUS_DIR = Path(__file__).resolve().parents[1] / "data" / "parity_fuzz"
# Order of the fields in a compact corpus step record.
FIELDS = (
    "step",
    "total_tokens",
    "sched",
    "admitted",
    "preempted",
    "finished",
    "num_running",
    "num_waiting",
    "kv_usage",
    # Cases with a scripted KV connector only: loads started, the step output's events.
    "kv_loads",
    "kv_out",
    # Cases with encoder inputs only (null connector fields before them without a connector).
    "enc",
    "enc_freed",
    # Cases recorded by tools/drive_vllm.py: the block ids handed over (null fields before it as needed).
    "blocks",
)
# Per-step bookkeeping checked after every schedule(), empty steps included.
BOOKKEEPING = ("step", "total_tokens", "num_running", "num_waiting", "kv_usage")
# Every knob value and workload shape the corpus must keep exercising.
REQUIRED_FEATURES = {
    "policy:fcfs",
    "policy:priority",
    "priority:ties",
    "chunked:on",
    "chunked:off",
    "threshold:0",
    "threshold:>0",
    "watermark:0",
    "watermark:>0",
    "reserve_full_isl:true",
    "reserve_full_isl:false",
    "prefix_caching:on",
    "prefix_caching:off",
    "kv:tight",
    "kv:roomy",
    "obs:preemption",
    "obs:resumed",
    "obs:prefix_hit",
    "obs:resumed_prefix_hit",
    "arrivals:spread",
    "obs:idle_gap",
    "prompt:identical",
    "prompt:shared_blocks",
    "prompt:prefix_block_multiple",
    "prompt:one_block",
    "prompt:one_token",
    "block_size:8",
    "block_size:16",
    "block_size:32",
    "max_num_seqs:small",
    "max_num_seqs:large",
    "mnbt:small",
    "mnbt:large",
    "max_tokens:1",
    "mml:larger",
    "mml:truncating",
    "form:ids",
    "form:len",
    "form:shared_prefix_len",
    "tokens:tiny_alphabet",
    "priority:late_arrivals_outrank",
    "arrivals:bursts",
    "obs:multi_preemption",
    "obs:budget_full",
    # llmsched decision paths, as tools/parity_fuzz.py tags them.
    "path:preempt_already_scheduled",
    "path:several_victims_for_one_request",
    "path:self_preemption",
    "path:watermark_blocked",
    "path:watermark_checked",
    "path:full_isl_blocked",
    "path:admission_kv_short",
    "path:admitted_partial_prefill",
    "path:partial_prefill_refused",
    "path:threshold_cap",
    "path:threshold_lifted_for_lone_request",
    "path:duplicate_hash",
    "path:evict_cached_block",
    "path:hit_on_free_block",
    "path:hit_on_held_block",
    # Both of vLLM's schedulers, and the paths only async scheduling has.
    "sched:sync",
    "sched:async",
    "path:async_max_tokens_in_flight",
    "path:async_preempted_in_flight",
    "path:async_stale_output_finished",
    # The KV-connector path (corpus-connector): every role and failure policy,
    # loads of both kinds, failed loads of both kinds, blocks held while sending.
    "connector:kv_consumer",
    "connector:kv_producer",
    "connector:kv_both",
    "connector:policy_recompute",
    "connector:policy_fail",
    "connector:offer_always",
    "obs:kv_load_async",
    "obs:kv_load_sync",
    "obs:kv_failed",
    "obs:kv_invalid",
    "obs:kv_sent",
    "obs:kv_load_after_preemption",
    # Hybrid (Mamba) models and streaming-input sessions (corpus-hybrid).
    "mamba:align",
    "mamba:none",
    "path:mamba_chunk_cut",
    "path:mamba_skip",
    "sessions",
    "sessions:close_step",
    "obs:session_resumed_with_kv",
    "path:session_resume",
    "path:session_input_queued",
    "path:session_close_queued",
    "path:session_close_aborts",
    # Encoder inputs (corpus-multimodal): shared images, a reused id at another
    # size, chunks kept from splitting an item, items encoded and evicted.
    "mm:on",
    "mm:shared_image",
    "mm:id_size_mismatch",
    "mm:no_chunked_mm_input",
    "obs:enc_scheduled",
    "obs:enc_evicted",
    "obs:mm_preemption",
}


def load_corpus(folder: Path = CORPUS_DIR) -> list[dict]:
    """Case records of every corpus file in ``folder``, header lines skipped."""
    cases = []
    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            cases.extend(rec for rec in map(json.loads, f) if "header" not in rec)
    return cases


def expand(steps: list[list]) -> list[dict]:
    """Compact step records back into trace-style dicts."""
    return [{k: v for k, v in zip(FIELDS, s) if v is not None} for s in steps]


def replay_ours(workload: dict) -> list[dict]:
    """llmsched's step records for a workload (header dropped)."""
    buf = io.StringIO()
    replay(parse_workload(workload), buf)
    return [json.loads(line) for line in buf.getvalue().splitlines()[1:]]


def differences(ours: list[dict], ref: list[dict], case: dict | None = None) -> list[str]:
    """Decision differences (parity.compare's criterion), then bookkeeping ones.

    Preemptions are compared in order where the case records vLLM's order
    (``"preempt_order": true``; older cases hold them sorted), finishes where
    vLLM's order is deterministic for the workload.
    """
    case = case or {}
    finish_order = "workload" not in case or finish_order_is_deterministic(case["workload"])
    diffs = compare(ours, ref, preempt_order=bool(case.get("preempt_order")), finish_order=finish_order)
    if len(decisions(ours)) != len(decisions(ref)) or not decisions(ref):
        diffs.append(f"{len(decisions(ours))} non-empty steps vs {len(decisions(ref))} recorded")
    if len(ours) != len(ref):
        diffs.append(f"{len(ours)} steps vs {len(ref)} recorded")
    for a, b in zip(ours, ref):
        for key in BOOKKEEPING:
            if a[key] != b[key]:
                diffs.append(f"step {b['step']}: {key} {a[key]!r} vs recorded {b[key]!r}")
        if a["admitted"] != b["admitted"]:
            diffs.append(f"step {b['step']}: admitted {a['admitted']} vs recorded {b['admitted']}")
        if "kv_out" in b and events(a.get("kv_out")) != events(b["kv_out"]):
            diffs.append(f"step {b['step']}: kv_out {a.get('kv_out')} vs recorded {b['kv_out']}")
        if len(diffs) > 5:
            break
    return diffs


CASES = load_corpus()


def test_corpus_is_large_and_covers_every_knob():
    """The corpus is there, names are unique, and every required knob and path is exercised."""
    assert len(CASES) >= 200
    assert len({c["name"] for c in CASES}) == len(CASES)
    covered = set().union(*(c["features"] for c in CASES))
    # Older corpus files predate the sched:* tags: the workload says its mode.
    modes = {bool(c["workload"]["config"].get("async_scheduling")) for c in CASES}
    covered |= {"sched:async" if m else "sched:sync" for m in modes}
    assert not REQUIRED_FEATURES - covered, sorted(REQUIRED_FEATURES - covered)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_case_matches_vllm(case: dict):
    """llmsched makes vLLM's recorded decisions, with the same bookkeeping, at every step."""
    ref = expand(case["steps"])
    assert differences(replay_ours(case["workload"]), ref, case) == []


def _corruptions(steps: list[dict]) -> list[list[dict]]:
    """Copies of a recorded trace with one decision or count altered."""
    out = []
    k = next(i for i, s in enumerate(steps) if len(s["sched"]) > 1)
    swapped = copy.deepcopy(steps)
    swapped[k]["sched"] = swapped[k]["sched"][::-1]
    out.append(swapped)
    more_tokens = copy.deepcopy(steps)
    more_tokens[k]["sched"][0][1] += 1
    out.append(more_tokens)
    preempted = copy.deepcopy(steps)
    preempted[k]["preempted"] = [*preempted[k]["preempted"], preempted[k]["sched"][0][0]]
    out.append(preempted)
    finished = copy.deepcopy(steps)
    j = next(i for i, s in enumerate(steps) if s["finished"] and s["total_tokens"])
    finished[j]["finished"] = []
    out.append(finished)
    usage = copy.deepcopy(steps)
    usage[k]["kv_usage"] = round(usage[k]["kv_usage"] + 1e-6, 6)
    out.append(usage)
    return out


def test_a_corrupted_record_is_caught():
    """The comparison is not vacuous: altering any one recorded decision or count fails it."""
    case = next(
        c for c in CASES if any(len(s[2]) > 1 for s in c["steps"]) and any(s[5] and s[1] for s in c["steps"])
    )
    ref = expand(case["steps"])
    ours = replay_ours(case["workload"])
    assert differences(ours, ref, case) == []
    for bad in _corruptions(ref):
        assert differences(ours, bad, case), "a corrupted record went unnoticed"


def test_a_corrupted_load_is_caught():
    """A connector case fails when a recorded load or connector event is altered."""
    case = next(
        c
        for c in CASES
        if any(len(s) > 9 and s[9] for s in c["steps"]) and any(len(s) > 10 and s[10] for s in c["steps"])
    )
    ref = expand(case["steps"])
    ours = replay_ours(case["workload"])
    assert differences(ours, ref, case) == []
    k = next(i for i, s in enumerate(ref) if s["kv_loads"])
    for change in ("drop_load", "more_tokens", "drop_event"):
        bad = copy.deepcopy(ref)
        if change == "drop_load":
            bad[k]["kv_loads"] = bad[k]["kv_loads"][1:]
        elif change == "more_tokens":
            bad[k]["kv_loads"][0][1] += 1
        else:
            j = next(i for i, s in enumerate(ref) if s["kv_out"])
            bad[j]["kv_out"] = {}
        assert differences(ours, bad, case), change


def test_a_corrupted_encoder_record_is_caught():
    """A multimodal case fails when a recorded encoder input or eviction is altered."""
    case = next(c for c in CASES if any(len(s) > 12 and s[12] for s in c["steps"]))
    ref = expand(case["steps"])
    ours = replay_ours(case["workload"])
    assert differences(ours, ref, case) == []
    k = next(i for i, s in enumerate(ref) if s["enc"])
    dropped = copy.deepcopy(ref)
    rid = next(iter(dropped[k]["enc"]))
    dropped[k]["enc"][rid] = dropped[k]["enc"][rid][1:] or [99]
    j = next(i for i, s in enumerate(ref) if s["enc_freed"])
    unevicted = copy.deepcopy(ref)
    unevicted[j]["enc_freed"] = []
    for bad in (dropped, unevicted):
        assert differences(ours, bad, case), "a corrupted encoder record went unnoticed"
