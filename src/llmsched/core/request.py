"""A request's token state as the scheduler sees it, and its stop checks."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmsched.core.mm_item import MMItem
from llmsched.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every value >= FINISHED_STOPPED is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Holds blocks that a KV connector is filling; waits until the load ends.
    WAITING_FOR_REMOTE_KVS = 3
    # Queued while its output grammar compiles; skipped by admission until ready.
    WAITING_FOR_GRAMMAR = 4
    # A resumable session whose turn finished: holds its blocks until its
    # next input arrives (vLLM's WAITING_FOR_STREAMING_REQ).
    WAITING_FOR_INPUT = 5
    FINISHED_STOPPED = 6
    FINISHED_LENGTH_CAPPED = 7
    FINISHED_ABORTED = 8
    FINISHED_ERROR = 9

    @property
    def finished(self) -> bool:
        """True for the terminal states."""
        return self >= RequestStatus.FINISHED_STOPPED


# OpenAI-style finish reasons for the terminal states.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

_EMPTY: frozenset[int] = frozenset()


@dataclass(slots=True)
class TurnEnd:
    """How a session's turn ended, kept on the request for the engine to report.

    Taken when the turn stops, before a queued input resumes the session and
    drops the turn's last sampled token from its history.
    """

    status: RequestStatus
    stop_reason: int | str | None
    output_token_ids: list[int]


class GrammarHandle(Protocol):
    """A request's output grammar as the scheduler sees it: only whether it is compiled.

    The engine's structured-output layer owns the grammar itself; executors
    read it from the same object.
    """

    @property
    def ready(self) -> bool:
        """True once compilation ended (successfully or not)."""
        ...


class Request:
    """One generation request: prompt, generated tokens and scheduling state.

    ``token_ids`` holds the prompt followed by the generated tokens;
    ``num_tokens`` is its length, kept as a plain attribute because the
    scheduler reads it for every running request in every step.
    ``num_computed_tokens`` counts tokens whose KV is computed or scheduled:
    the scheduler advances it when it schedules, not when output returns.
    ``copy_prompt=False`` keeps the prompt list it is given rather than a
    copy, for callers that build one per request and never change it.
    """

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "drop_stale_output",
        "eos_token_ids",
        "grammar",
        "input_queue",
        "is_prefill_chunk",
        "lora_id",
        "lora_name",
        "max_tokens",
        "min_tokens",
        "mm_items",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "num_stale_output_tokens",
        "num_tokens",
        "priority",
        "prompt_token_ids",
        "request_id",
        "resumable",
        "sampling_params",
        "skip_prefix_cache",
        "spec_token_ids",
        "status",
        "stop_ids",
        "stop_length",
        "stop_reason",
        "stop_token_ids",
        "tenant",
        "token_ids",
        "turn_end",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        lora_id: int = 0,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        skip_prefix_cache: bool = False,
        grammar: GrammarHandle | None = None,
        tenant: str | None = None,
        resumable: bool = False,
        mm_items: Sequence[MMItem] = (),
        copy_prompt: bool = True,
    ) -> None:
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.request_id = request_id
        # copy_prompt=False: the caller hands over a list nobody changes
        # afterwards (the simulator builds one per request), which saves a
        # copy of the prompt, and later freeing it, per request.
        if not copy_prompt and isinstance(prompt_token_ids, list):
            self.prompt_token_ids = prompt_token_ids
        else:
            self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_tokens = self.num_prompt_tokens
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []
        self.sampling_params = params
        self.max_tokens = params.max_tokens
        self.min_tokens = params.min_tokens
        self.eos_token_ids = _EMPTY if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids) or _EMPTY
        # The union is what the per-token fast path tests; the parts only
        # matter once it matches.
        self.stop_ids = (self.eos_token_ids | self.stop_token_ids) or _EMPTY
        # Set by the scheduler from max_model_len when the request is added.
        self.stop_length = self.num_prompt_tokens + self.max_tokens
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.lora_id = lora_id
        self.lora_name = lora_name if lora_name is not None else (str(lora_id) if lora_id else None)
        self.cache_salt = cache_salt
        # Either says so: a request asking for prompt logprobs computes every position.
        self.skip_prefix_cache = skip_prefix_cache or bool(params.skip_reading_prefix_cache)
        # Who sent it, for fair-share policies and per-tenant metrics.
        self.tenant = tenant
        # Encoder inputs (images), sorted by offset; their embeddings fill
        # placeholder positions of the prompt.
        self.mm_items: tuple[MMItem, ...] = tuple(mm_items)
        # A constrained request waits for its grammar (ready or not: the
        # scheduler checks when it reaches the head of the queue).
        self.grammar = grammar
        self.status = RequestStatus.WAITING if grammar is None else RequestStatus.WAITING_FOR_GRAMMAR
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        # Prefix-cache hit at first admission, for usage reporting.
        self.num_cached_tokens = -1
        self.is_prefill_chunk = False
        # Async scheduling only (all stay 0 in sync mode). Placeholders are
        # tokens a scheduled step will sample but whose values are not yet
        # applied; computed counts them. In-flight tokens are scheduled but
        # not yet reported back. Stale tokens are the in-flight share of a
        # preempted request: its output still arrives, but must not move the
        # counters that preemption reset.
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        # In-flight output of a finished session turn: dropped, not delivered
        # (its positions are resampled by the next turn).
        self.drop_stale_output = False
        # A resumable request is a session: later inputs under its id extend
        # it (see core.session). Inputs that arrive while a turn runs queue
        # here; None marks the end of input.
        self.resumable = resumable
        self.input_queue: deque[Request | None] | None = deque() if resumable else None
        # Set by the scheduler when a session's turn ends (TurnEnd),
        # cleared by whoever reports it: resuming rewrites the turn's tokens.
        self.turn_end: TurnEnd | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal status."""
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """'stop', 'length', 'abort' or 'error' once finished, else None."""
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        """Append one generated token."""
        self.token_ids.append(token_id)
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


def check_stop(request: Request, token_id: int) -> bool:
    """Apply the stop rules after ``token_id`` was appended; set status if stopped.

    Order follows vLLM: EOS, then stop token ids, then the length limits
    (max_tokens and max_model_len, folded into ``stop_length``). EOS and stop
    tokens count only once more than ``min_tokens`` tokens exist: the sampler
    masks them before that, so a fabricated one is treated as ordinary text.
    """
    if token_id in request.stop_ids and request.num_tokens - request.num_prompt_tokens > request.min_tokens:
        request.status = RequestStatus.FINISHED_STOPPED
        if token_id not in request.eos_token_ids:
            request.stop_reason = token_id
        return True
    if request.num_tokens >= request.stop_length:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
