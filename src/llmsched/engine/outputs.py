"""What the engine returns per request, shaped as vLLM users know it.

``RequestOutput.outputs`` holds ``CompletionOutput``s (one; or for a request
with n > 1, all n sorted by ``index`` in its FINAL_ONLY output, and the
child that progressed in a streamed one), each with ``text``,
``token_ids``, ``finish_reason`` ("stop", "length", "abort" or "error"),
``stop_reason`` (the stop string or stop token id) and logprobs;
``metrics`` carries the request's timestamps (``time.monotonic()`` seconds)
and TTFT, TPOT and end-to-end latency derived from them.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    """What ``step()`` reports for a request: everything so far, only what is new, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class Logprob:
    """One candidate token's log probability, its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: candidate token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class RequestMetrics:
    """A request's timestamps (``time.monotonic()`` seconds; NaN until they happen)."""

    arrival_time: float
    first_scheduled_time: float = math.nan
    first_token_time: float = math.nan
    last_token_time: float = math.nan
    finished_time: float = math.nan
    num_generation_tokens: int = 0
    # Times the scheduler preempted the request (its KV recomputed after each).
    num_preemptions: int = 0

    @property
    def time_in_queue(self) -> float:
        """Arrival to first scheduled, seconds."""
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float:
        """Time to first token: arrival to the first output token, seconds."""
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float:
        """Time per output token after the first, seconds (0 with fewer than two tokens)."""
        if self.num_generation_tokens < 2:
            return 0.0
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival to finish (or to the last token while running), seconds."""
        end = self.finished_time if not math.isnan(self.finished_time) else self.last_token_time
        return end - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence; ``index`` is its place among the request's n (0 when n=1)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One request's result so far; ``finished`` once it is final.

    ``prompt`` is None when the request was given as token ids. ``error``
    holds the message when the request failed on its own (finish_reason
    "error"); other requests are unaffected.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # A prefill instance's answer for its decode instance (disaggregated prefill/decode).
    kv_transfer_params: dict | None = None
    # Asked for with SamplingParams.prompt_logprobs: per prompt position (the
    # first None) the prompt token's Logprob and the top-N, as vLLM gives them;
    # reported once every position is computed (a DELTA stream: once).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def turn_finished(self) -> bool:
        """True when a streaming-input session's turn ended (its finish_reason is set), or all ended."""
        return self.finished or any(o.finish_reason is not None for o in self.outputs)

    def __repr__(self) -> str:
        o = self.outputs[0] if self.outputs else None
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"text={o.text if o else None!r}, num_tokens={len(o.token_ids) if o else 0}, "
            f"finished={self.finished}, finish_reason={o.finish_reason if o else None!r}"
            + (f", error={self.error!r})" if self.error else ")")
        )
