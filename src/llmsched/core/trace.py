"""Per-step decision records: what each request got, or why it got nothing.

Tracing is off by default. When off, the scheduler holds ``None`` and each
decision point costs one identity test; nothing here is allocated.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmsched.core.request import Request

# Waiting requests the scheduler never looked at in a step are listed up to
# this many; the rest are only counted, so a deep queue cannot bloat a step.
MAX_LISTED_WAITING = 32

# Why an admitted request got no prefix-cache hit although caching is on
# (said in its SCHEDULED entry's detail, which is where hits are told).
PREFIX_CACHE_NOT_READ = (
    "prefix cache not read (skip_reading_prefix_cache: prompt logprobs need every position)"
)


class Reason(str, enum.Enum):
    """Outcome of one request in one step."""

    SCHEDULED = "scheduled"
    NOTHING_TO_COMPUTE = "nothing_to_compute"
    MAX_TOKENS_IN_FLIGHT = "max_tokens_in_flight"
    OUTPUT_IN_FLIGHT = "output_in_flight"
    BUDGET = "token_budget_spent"
    MAX_NUM_SEQS = "max_num_seqs_reached"
    KV_SHORT = "kv_blocks_short"
    WATERMARK = "watermark"
    NO_CHUNKING = "prompt_exceeds_budget_unchunked"
    LORA_SLOTS = "lora_slots_full"
    PREEMPTED = "preempted"
    PREEMPTION_STEP = "no_admission_in_preempting_step"
    QUEUED = "queued_behind"
    ADMISSION_GATED = "admission_gated"
    PREFILL_DEFERRED = "prefill_deferred"
    BALANCE_GATE = "dp_balance_gate"
    REMOTE_KV = "waiting_for_remote_kv"
    KV_LOAD_FAILED = "kv_load_failed_recomputing"
    SENDING = "blocks_held_while_sending"
    GRAMMAR_COMPILING = "grammar_compiling"
    # Decisions of the policies beyond FCFS and priority.
    SKIPPED_NO_ROOM = "skipped_no_room"
    PREEMPTED_FOR_WAITING = "preempted_for_waiting_priority"
    FAIR_SHARE_HOLD = "held_for_fair_share"
    DEADLINE_DECLINED = "declined_for_deadline"
    POLICY_HOLD = "held_by_policy"
    MAMBA_ALIGNMENT = "mamba_block_alignment"
    WAITING_FOR_INPUT = "session_waiting_for_input"
    ENCODER_HELD = "encoder_input_held"


_TEXT = {
    Reason.SCHEDULED: "ran",
    Reason.NOTHING_TO_COMPUTE: "nothing to compute",
    Reason.MAX_TOKENS_IN_FLIGHT: "already certain to reach max_tokens",
    Reason.OUTPUT_IN_FLIGHT: "preempted step's output still in flight",
    Reason.BUDGET: "token budget spent",
    Reason.MAX_NUM_SEQS: "max_num_seqs reached",
    Reason.KV_SHORT: "KV blocks short",
    Reason.WATERMARK: "would break the KV watermark",
    Reason.NO_CHUNKING: "prompt does not fit the budget and chunked prefill is off",
    Reason.LORA_SLOTS: "LoRA slots full",
    Reason.PREEMPTED: "preempted",
    Reason.PREEMPTION_STEP: "no admissions in a step that preempted",
    Reason.QUEUED: "still queued",
    Reason.ADMISSION_GATED: "admission gated",
    Reason.PREFILL_DEFERRED: "prefill deferred by the prefill cadence",
    Reason.BALANCE_GATE: "held by the data-parallel balance gate",
    Reason.REMOTE_KV: "waiting for remote KV",
    Reason.KV_LOAD_FAILED: "KV load failed, recomputing",
    Reason.SENDING: "finished, blocks held while its KV is sent",
    Reason.GRAMMAR_COMPILING: "output grammar still compiling",
    Reason.SKIPPED_NO_ROOM: "skipped: no room now, those behind it may go",
    Reason.PREEMPTED_FOR_WAITING: "preempted for a waiting request of higher priority",
    Reason.FAIR_SHARE_HOLD: "held for fair share",
    Reason.DEADLINE_DECLINED: "declined: its TTFT deadline cannot be met",
    Reason.POLICY_HOLD: "held by the scheduling policy",
    Reason.MAMBA_ALIGNMENT: "no block-aligned prefill chunk fits the budget left (hybrid model)",
    Reason.WAITING_FOR_INPUT: "session waiting for its next input",
    Reason.ENCODER_HELD: "an encoder input does not fit the encoder budget or cache",
}


@dataclass(slots=True)
class TraceEntry:
    """One request's outcome; ``detail`` carries the numbers behind it."""

    request_id: str
    reason: Reason
    num_tokens: int = 0
    detail: str = ""

    def to_json(self) -> list:
        """[id, tokens, reason, detail]: compact for JSONL traces."""
        return [self.request_id, self.num_tokens, self.reason.value, self.detail]

    def text(self) -> str:
        """A human-readable line."""
        head = f"{self.request_id}: {_TEXT[self.reason]}"
        if self.reason is Reason.SCHEDULED:
            head += f" {self.num_tokens} token{'s' if self.num_tokens != 1 else ''}"
        return f"{head} ({self.detail})" if self.detail else head


@dataclass(slots=True)
class StepTrace:
    """Every request the scheduler considered in one step, in the order it did."""

    step: int
    entries: list[TraceEntry] = field(default_factory=list)
    # Waiting requests neither considered nor listed (see MAX_LISTED_WAITING).
    num_unlisted_waiting: int = 0

    def add(self, request_id: str, reason: Reason, num_tokens: int = 0, detail: str = "") -> None:
        """Record one outcome."""
        self.entries.append(TraceEntry(request_id, reason, num_tokens, detail))

    def reason_of(self, request_id: str) -> TraceEntry | None:
        """The last entry for ``request_id`` in this step."""
        for e in reversed(self.entries):
            if e.request_id == request_id:
                return e
        return None

    def to_json(self) -> dict:
        """The ``why`` field of a step record."""
        out: dict = {"entries": [e.to_json() for e in self.entries]}
        if self.num_unlisted_waiting:
            out["unlisted_waiting"] = self.num_unlisted_waiting
        return out

    def explain(self) -> str:
        """Multi-line summary of the step."""
        ran = [e for e in self.entries if e.reason is Reason.SCHEDULED]
        tokens = sum(e.num_tokens for e in ran)
        lines = [f"step {self.step}: {len(ran)} request{'s' if len(ran) != 1 else ''} ran {tokens} tokens"]
        lines.extend("  " + e.text() for e in self.entries)
        if self.num_unlisted_waiting:
            lines.append(f"  ... and {self.num_unlisted_waiting} more waiting")
        return "\n".join(lines)


def trace_unreached(trace: StepTrace, reqs: list[Request]) -> None:
    """Trace the running requests the loop never reached: the budget ran out first."""
    for req in reqs:
        trace.add(req.request_id, Reason.BUDGET, detail="reached after the budget ran out")


def trace_scheduled(
    trace: StepTrace,
    req: Request,
    start: int,
    n: int,
    wanted: int,
    budget: int,
    threshold: int,
    max_model_len: int,
    held: str = "",
    admitted: bool = False,
    caching: bool = False,
) -> None:
    """Record ``req``'s chunk of ``n`` tokens after ``start`` (``wanted``: its want), and what capped it.

    ``held``: what held the chunk short; ``admitted``: an admission, for which
    ``caching`` (prefix caching on) says whether skipping the cache is told.
    """
    if start >= req.num_tokens - 1:
        what = "decode" if n == 1 else f"decode with {n - 1} draft tokens"
    else:
        what = f"{'recompute' if req.num_preemptions else 'prefill'} {start}-{start + n} of {req.num_tokens}"
    if admitted:
        what = (
            ("resumed" if req.num_preemptions else "admitted")
            + (f" with a prefix-cache hit of {start} tokens, " if start else ", ")
            + what
        )
        if req.skip_prefix_cache and caching:
            what += f", {PREFIX_CACHE_NOT_READ}"
    if n < wanted:
        if threshold and n == threshold:
            what += f", capped by long_prefill_token_threshold={threshold}"
        elif n == budget:
            what += ", capped by the token budget"
        elif held:
            what += f", stopped before {held}"
        else:
            what += f", capped by max_model_len={max_model_len}"
    trace.add(req.request_id, Reason.SCHEDULED, n, what)


def trace_waiting(
    trace: StepTrace,
    waiting: Iterable[Request],
    set_aside: list[Request] | None,
    head_reason: Reason,
    detail: str,
    whole_queue: bool = False,
) -> None:
    """Explain the waiting requests this step did not admit.

    ``whole_queue``: the reason applies to every waiting request (a gate,
    a preempting step), not only to the head the others queue behind.
    """
    head: Request | None = None
    listed = 0
    skip = set(set_aside or ())
    for req in waiting:
        if req in skip:
            continue
        if head is None:
            head = req
            trace.add(req.request_id, head_reason, detail=detail)
        elif listed < MAX_LISTED_WAITING:
            listed += 1
            if whole_queue:
                trace.add(req.request_id, head_reason, detail=detail)
            else:
                trace.add(req.request_id, Reason.QUEUED, detail=f"behind {head.request_id}")
        else:
            trace.num_unlisted_waiting += 1
