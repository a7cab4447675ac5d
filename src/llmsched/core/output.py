"""What the scheduler hands the executor, and what comes back.

Executors run in the scheduler's process, so the output carries the Request
objects themselves (read-only for executors) rather than copies of their
token lists: a decode step then costs two list appends per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmsched.core.connector import KVConnectorOutput
from llmsched.core.request import Request
from llmsched.core.trace import StepTrace


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch.

    ``scheduled[i]`` runs ``num_scheduled_tokens[i]`` tokens. Running requests
    come first in running order, then this step's admissions in admission
    order. When the executor runs, ``request.num_computed_tokens`` already
    includes this step's tokens, so a chunk starts at
    ``num_computed_tokens - num_scheduled_tokens[i]``.
    """

    step: int
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Admitted this step (new or resumed): their whole block table, their
    # prefix-cache hit in tokens, whether they resume after a preemption (as
    # of this step: with async scheduling a later step may preempt them
    # before this one's output is applied).
    admitted: list[Request] = field(default_factory=list)
    admitted_block_ids: list[list[int]] = field(default_factory=list)
    admitted_num_cached_tokens: list[int] = field(default_factory=list)
    admitted_resumed: list[bool] = field(default_factory=list)
    # Admitted requests whose prefix-cache hit covers blocks a withdrawn chunk
    # registered but never computed (rare): request id -> first position whose
    # KV must be recomputed. The token budget counts only the scheduled tokens
    # (as vLLM decides them); executors that hold real KV also compute
    # [recompute_from, chunk start) for these requests.
    recompute_from: dict[str, int] = field(default_factory=dict)
    # Running requests that grew their table this step: the appended block ids.
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Draft tokens scheduled for verification, by request id.
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    # Finished or aborted since the previous step: executors drop their state.
    finished_req_ids: list[str] = field(default_factory=list)
    trace: StepTrace | None = None
    # What the KV connector's worker side needs for this step (loads to
    # start, blocks to send); None without a connector.
    kv_connector_metadata: object = None
    # Multimodal only (None otherwise): encoder inputs to encode this step
    # (request id -> item indices) and content hashes evicted from the
    # encoder cache, whose outputs executors drop.
    encoder_inputs: dict[str, list[int]] | None = None
    freed_encoder_ids: list[str] | None = None
    # Hybrid (Mamba) models only (None otherwise): per scheduled request, the
    # block holding the state its chunk starts from (-1: position 0, no
    # state) and the block its final state goes to (may be the same).
    mamba_state_ids: dict[str, tuple[int, int]] | None = None

    def chunks(self) -> list[tuple[Request, int, int]]:
        """(request, first position, token count) for each scheduled request."""
        return [(r, r.num_computed_tokens - n, n) for r, n in zip(self.scheduled, self.num_scheduled_tokens)]

    def num_scheduled_tokens_by_id(self) -> dict[str, int]:
        """Request id -> scheduled tokens, in schedule order."""
        return {r.request_id: n for r, n in zip(self.scheduled, self.num_scheduled_tokens)}


@dataclass(slots=True)
class ModelRunnerOutput:
    """The executor's answer, parallel to ``SchedulerOutput.scheduled``.

    ``sampled_token_ids[i]`` is empty for a partial prefill chunk, one token
    for a plain step, and 1 + accepted drafts under speculative decoding.
    ``draft_token_ids[i]``, when given, are drafts to verify next step.
    ``logprobs`` and ``extra`` pass through to the engine untouched.
    """

    sampled_token_ids: Sequence[Sequence[int]]
    draft_token_ids: Sequence[Sequence[int]] | None = None
    logprobs: Sequence[object] | None = None
    extra: object = None
    # The KV connector's events (finished or failed transfers), if any.
    kv_connector_output: KVConnectorOutput | None = None
    # Speculative decoding: drafts the executor really verified per request
    # (async placeholders with no draft behind them are not), for statistics.
    num_drafts_verified: Sequence[int] | None = None
    # Requests asking for prompt logprobs: request id -> (first position,
    # entries), one entry per prompt position from there (the entry for
    # position p is the logprob of prompt token p, from the logits at p - 1).
    prompt_logprobs: dict[str, tuple[int, list[object]]] | None = None


@dataclass(slots=True)
class StepOutputs:
    """What ``update_from_output`` changed: requests with new tokens, finishes."""

    updated: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
