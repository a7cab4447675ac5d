"""What travels between the HTTP side and the engine loop (across a pipe when the engine is a process).

Everything here is small and picklable. Outputs travel as OutputDelta, not
RequestOutput: a delta carries only what changed, never the prompt again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.lora_request import LoRARequest
from llmsched.engine.outputs import Logprob, RequestOutput

# Why an add was refused: the scheduler refused the request (a 400), or the engine failed.
REJECTED = "rejected"
FAILED = "failed"


@dataclass(slots=True)
class Add:
    """Queue a request (token ids already; tokenizing happens on the HTTP side)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    kv_transfer_params: dict | None = None
    # Decoded images (PIL), one per image placeholder of the prompt.
    images: list | None = None
    lora_request: LoRARequest | None = None
    # A streaming-input session's input (the first opens it; later ones resume it).
    resumable: bool = False
    # A later input: refused if its session has ended meanwhile, never opening a new one.
    continues: bool = False


@dataclass(slots=True)
class LoRAOp:
    """Load (a LoRARequest) or unload (an adapter id) an adapter; answered with a LoRAReply."""

    token: int
    load: LoRARequest | None = None
    unload: int | None = None


@dataclass(slots=True)
class LoRAReply:
    """The answer to a LoRAOp: None, or why it failed."""

    token: int
    error: str | None


@dataclass(slots=True)
class Abort:
    """Abort a request; a no-op once it finished."""

    request_id: str


@dataclass(slots=True)
class EndInput:
    """End a session's input: it finishes after its running turn (at once between turns)."""

    request_id: str


@dataclass(slots=True)
class Query:
    """Ask the engine loop for the latest ``last`` step records; answered with a Reply."""

    token: int
    last: int
    explain: bool = False
    # Data parallelism: only this rank's records (None: every rank's).
    rank: int | None = None


@dataclass(slots=True)
class Stop:
    """Finish the engine loop (what is in flight fails)."""


@dataclass(slots=True)
class OutputDelta:
    """One request's new text and tokens from one step; ``final`` timing only when finished.

    ``final`` is (arrival, first scheduled, finished, time per output
    token, generated tokens, preemptions), times on the monotonic clock the
    server shares.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    final: tuple[float, float, float, float, int, int] | None = None
    # A prefill instance's answer for the decode instance (final output only).
    kv_transfer_params: dict | None = None
    # Asked for: the prompt's logprobs (first position None), in one output only.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @classmethod
    def of(cls, out: RequestOutput) -> OutputDelta:
        """The delta of an engine output (RequestOutputKind.DELTA)."""
        c = out.outputs[0]
        final = None
        if out.finished and out.metrics is not None:
            m = out.metrics
            final = (
                m.arrival_time,
                m.first_scheduled_time,
                m.finished_time,
                m.tpot,
                m.num_generation_tokens,
                m.num_preemptions,
            )
        return cls(
            out.request_id,
            c.text,
            c.token_ids,
            c.logprobs,
            out.finished,
            c.finish_reason,
            c.stop_reason,
            out.num_cached_tokens,
            final,
            out.kv_transfer_params,
            out.prompt_logprobs,
        )


@dataclass(slots=True)
class EngineSnapshot:
    """Scheduler figures as of the latest step (replaced whole, never mutated)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_usable_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    # Tokens the latest step scheduled (prompt chunks and decodes).
    step_tokens: int = 0
    # (reason, count) for the waiting requests, in the decision trace's vocabulary.
    waiting_by_reason: tuple[tuple[str, int], ...] = ()
    # Sampled KV block lives that ended since the previous snapshot: (lifetime, idle, reuse gaps).
    kv_evictions: tuple[tuple[float, float, tuple[float, ...]], ...] = ()
    # Speculative decoding, cumulative: (drafts, draft tokens, accepted tokens,
    # accepted per draft position); None when speculation is off.
    spec_decode: tuple[int, int, int, tuple[int, ...]] | None = None
    # A KV connector's lookups: prompt tokens queried, tokens loaded from another instance.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Vision-language models: (usage fraction, entries, items found cached, items encoded).
    encoder_cache: tuple[float, int, int, int] | None = None
    # The data-parallel rank (vLLM's ``engine`` label) whose scheduler this is.
    engine: int = 0


@dataclass(slots=True)
class StepBatch:
    """One step's outputs, when their tokens were sampled, and the scheduler's state after it."""

    outputs: list[OutputDelta]
    token_time: float = math.nan
    snapshot: EngineSnapshot | None = None
    # The data-parallel rank that ran the step.
    rank: int = 0


@dataclass(slots=True)
class Acks:
    """Adds processed: (request id, None) or (request id, (REJECTED or FAILED, message))."""

    items: list[tuple[str, tuple[str, str] | None]] = field(default_factory=list)


@dataclass(slots=True)
class Failed:
    """These requests failed in the engine; the message says why."""

    request_ids: list[str]
    message: str


@dataclass(slots=True)
class Dead:
    """The engine loop stopped for good (crash or shutdown)."""

    message: str


@dataclass(slots=True)
class Reply:
    """The answer to a Query."""

    token: int
    steps: list[dict]


@dataclass(slots=True)
class EngineInfo:
    """What the HTTP side needs to know about the engine it talks to."""

    model_path: str
    model_notice: str | None
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    scheduling_policy: str
    generation_defaults: dict
    trace_steps: int
    snapshot: EngineSnapshot
    # The KV cache settings, as vLLM's cache_config_info labels them.
    cache_config: dict[str, str] = field(default_factory=dict)
    kv_cache_metrics: bool = False
    # The engine's startup lines the server prints (the batch limits chosen, as vLLM logs them).
    startup_log: list[str] = field(default_factory=list)


# Between processes a step batch travels as plain tuples: pickling a hundred
# slotted dataclasses costs ten times as much, and it is paid on the engine's side.
BATCH_TAG = "step"


def encode_batch(batch: StepBatch) -> tuple:
    """A StepBatch as nested plain tuples (for the pipe)."""
    outs = [
        (o.request_id, o.text, o.token_ids, o.logprobs, o.finished, o.finish_reason, o.stop_reason,
         o.num_cached_tokens, o.final, o.kv_transfer_params, o.prompt_logprobs)
        for o in batch.outputs
    ]  # fmt: skip
    snap = batch.snapshot
    snap_t = None
    if snap is not None:
        snap_t = (
            snap.num_running, snap.num_waiting, snap.kv_usage, snap.num_free_blocks, snap.num_usable_blocks,
            snap.num_preemptions, snap.prefix_cache_queries, snap.prefix_cache_hits, snap.num_steps,
            snap.step_tokens, snap.waiting_by_reason, snap.kv_evictions, snap.spec_decode,
            snap.external_prefix_cache_queries, snap.external_prefix_cache_hits,
        )  # fmt: skip
    return (BATCH_TAG, outs, batch.token_time, snap_t)


def decode_batch(data: tuple) -> StepBatch:
    """The StepBatch ``encode_batch`` encoded."""
    _, outs, token_time, snap_t = data
    snapshot = EngineSnapshot(*snap_t) if snap_t is not None else None
    return StepBatch([OutputDelta(*o) for o in outs], token_time, snapshot)
