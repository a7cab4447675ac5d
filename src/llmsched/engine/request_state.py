"""The engine's per-request bookkeeping: text, logprobs, timestamps, and the outputs made from them."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmsched.core.request import FINISH_REASONS, Request, TurnEnd
from llmsched.engine.detokenizer import IncrementalDetokenizer
from llmsched.engine.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    SampleLogprobs,
)

if TYPE_CHECKING:
    from llmsched.engine.parallel_sampling import ParentRequest


@dataclass(slots=True)
class SessionState:
    """What the engine tracks for a session besides its RequestState."""

    # Prompt texts (None for token ids) of inputs the scheduler queued behind the running turn.
    pending_prompts: deque[str | None] = field(default_factory=deque)
    # Set once the input ended (end_session): no input is accepted after it.
    input_ended: bool = False
    # (finish_reason, stop_reason) of the latest turn, reported when the session ends between turns.
    last_reason: tuple[str | None, int | str | None] | None = None
    # The running turn's prompt (resuming gives the request a new list, so this one stays the turn's).
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestState:
    """One live request as the engine (not the scheduler) tracks it."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    output_kind: RequestOutputKind
    # None unless the request asked for logprobs.
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # Output tokens already handed to the detokenizer.
    num_seen: int = 0
    # Output tokens / logprobs already returned (DELTA outputs).
    num_sent: int = 0
    # Set for a streaming-input session (see engine.sessions).
    session: SessionState | None = None
    # Set for a child of a request with n > 1: the parent gathers its outputs.
    parent: ParentRequest | None = None
    # The child's index among its parent's n (its CompletionOutput.index).
    index: int = 0
    # Asked for prompt logprobs: one entry per prompt position (None for the
    # first), filled chunk by chunk; reported once the last position is in.
    # Positions a prefix-cache hit covered (skip_reading_prefix_cache=False)
    # were never computed and stay None.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_done: bool = False
    prompt_logprobs_sent: bool = False

    def want_prompt_logprobs(self, num_prompt_tokens: int) -> None:
        """Start collecting the prompt's logprobs (position 0 has none)."""
        self.prompt_logprobs = [None] * num_prompt_tokens
        self.prompt_logprobs_done = num_prompt_tokens <= 1

    def add_prompt_logprobs(
        self, first: int, entries: Sequence[object], decode_one: Callable[[int], str] | None
    ) -> None:
        """Record the executor's logprobs for prompt positions ``first``, ``first + 1``, ..."""
        plp = self.prompt_logprobs
        if plp is None:
            return
        for pos, entry in enumerate(entries, first):
            # A recomputed chunk (after a preemption) brings positions already in.
            if pos >= len(plp) or plp[pos] is not None:
                continue
            d = _to_logprob_dict(entry)
            if decode_one is not None:
                for tid, lp in d.items():
                    if lp.decoded_token is None:
                        lp.decoded_token = decode_one(tid)
            plp[pos] = d
        # Chunks run in order: the last position means the prompt is through.
        self.prompt_logprobs_done = plp[-1] is not None

    def _prompt_logprobs_to_report(self) -> list[dict[int, Logprob] | None] | None:
        """Complete prompt logprobs for this output (a DELTA stream gets them once), else None."""
        if self.prompt_logprobs is None or not self.prompt_logprobs_done:
            return None
        if self.output_kind is RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    def new_token_ids(self) -> list[int]:
        """Output tokens the scheduler appended since the last call."""
        req = self.request
        start = req.num_prompt_tokens + self.num_seen
        new = req.token_ids[start:]
        self.num_seen += len(new)
        return new

    def turn_token_ids(self, turn: TurnEnd) -> list[int]:
        """A session turn's output tokens not yet seen; the next turn's count starts from zero."""
        new = turn.output_token_ids[self.num_seen :]
        self.num_seen = 0
        return new

    def start_turn(self, prompt: str | None) -> None:
        """A session resumed with its next input (``prompt``: its text, if given as text)."""
        req = self.request
        self.num_seen = 0
        if self.session is not None:
            self.session.prompt_token_ids = req.prompt_token_ids
        self.detokenizer.new_context(req.prompt_token_ids)
        if prompt is not None:
            self.prompt = prompt if self.prompt is None else self.prompt + prompt
        m = self.metrics
        # Latencies are per turn; generated-token counts run on across the session.
        m.arrival_time = req.arrival_time
        m.first_scheduled_time = m.first_token_time = math.nan

    def add_logprobs(
        self, entries: Sequence[object], sampled: Sequence[int], decode_one: Callable[[int], str] | None
    ) -> None:
        """Record the logprobs the executor returned for ``sampled`` tokens."""
        if self.logprobs is None:
            return
        for entry, token in zip(entries, sampled):
            d = _to_logprob_dict(entry)
            if decode_one is not None:
                for tid, lp in d.items():
                    if lp.decoded_token is None:
                        lp.decoded_token = decode_one(tid)
            self.logprobs.append(d)
            chosen = d.get(token)
            if chosen is not None and self.cumulative_logprob is not None:
                self.cumulative_logprob += chosen.logprob
            elif chosen is None:
                self.cumulative_logprob = None

    def make_output(
        self, finished: bool, reason: tuple[str | None, int | str | None] | None = None
    ) -> RequestOutput | None:
        """The RequestOutput to report now, or None when this kind reports nothing yet.

        ``reason`` (finish_reason, stop_reason) ends a session's turn (or the
        session, between turns) with that reason instead of the request's status.
        """
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        ended = finished or reason is not None
        det = self.detokenizer
        req = self.request
        ids = det.token_ids
        # Tokens cut after a stop string never reach the output.
        n_ids = len(ids)
        logprobs = self.logprobs[:n_ids] if self.logprobs is not None else None
        if kind is RequestOutputKind.DELTA:
            text = det.delta_text(ended)
            token_ids = ids[self.num_sent :]
            if logprobs is not None:
                logprobs = logprobs[self.num_sent :]
            self.num_sent = n_ids
            if not ended and not text and not token_ids:
                return None
        else:
            text = det.output_text(ended)
            token_ids = list(ids)
        if reason is None:
            reason = (req.finish_reason, req.stop_reason) if finished else (None, None)
        completion = CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=reason[0],
            stop_reason=reason[1],
        )
        self.metrics.num_preemptions = req.num_preemptions
        return RequestOutput(
            request_id=req.request_id,
            prompt=self.prompt,
            prompt_token_ids=req.prompt_token_ids if self.session is None else self.session.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=self.metrics,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=self._prompt_logprobs_to_report(),
        )


def turn_reason(turn: TurnEnd) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) of a session's ended turn."""
    return FINISH_REASONS.get(turn.status), turn.stop_reason


def error_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: Sequence[int],
    message: str,
    arrival_time: float,
    n: int = 1,
) -> RequestOutput:
    """A finished output for a request that failed on its own: n empty completions, finish_reason "error"."""
    metrics = RequestMetrics(arrival_time=arrival_time, finished_time=arrival_time)
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=list(prompt_token_ids),
        outputs=[CompletionOutput(index=i, text="", token_ids=[], finish_reason="error") for i in range(n)],
        finished=True,
        metrics=metrics,
        error=message,
    )


def _to_logprob_dict(entry: object) -> dict[int, Logprob]:
    """One token's logprobs from the executor, as {token id: Logprob}.

    Accepted: the torch executor's TokenLogprobs (``token_id``, ``logprob``,
    ``rank``, ``top`` as (id, logprob) pairs, most likely first), a mapping
    id -> float | Logprob | (logprob, rank), or parallel sequences
    (ids, logprobs[, ranks]). As in vLLM the sampled token comes first, then
    the top-N.
    """
    top = getattr(entry, "top", None)
    if top is not None:
        out = {int(entry.token_id): Logprob(float(entry.logprob), int(entry.rank))}  # type: ignore[attr-defined]
        for rank, (tid, lp) in enumerate(top, 1):
            out.setdefault(int(tid), Logprob(float(lp), rank))
        return out
    if isinstance(entry, Mapping):
        out: dict[int, Logprob] = {}
        for tid, v in entry.items():
            if isinstance(v, Logprob):
                out[int(tid)] = v
            elif isinstance(v, (tuple, list)):
                out[int(tid)] = Logprob(float(v[0]), int(v[1]) if len(v) > 1 and v[1] is not None else None)
            else:
                out[int(tid)] = Logprob(float(v))  # type: ignore[arg-type]
        return out
    if isinstance(entry, (tuple, list)) and len(entry) in (2, 3):
        ids, lps = entry[0], entry[1]
        ranks = entry[2] if len(entry) == 3 else [None] * len(ids)
        return {
            int(t): Logprob(float(lp), int(r) if r is not None else None) for t, lp, r in zip(ids, lps, ranks)
        }
    return {}
