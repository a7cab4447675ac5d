"""Streaming-input sessions: resumable requests that take more input after they answer.

A session is a request added with ``resumable=True``. When a turn ends
(max_tokens, a stop token) the session is not freed: it keeps its KV blocks
and either resumes at once with an input that arrived meanwhile or waits for
one (``WAITING_FOR_INPUT``, queued among the requests holding blocks, and
skipped by admission). A later request with the same id is its next input:
resuming keeps every token but the last sampled one (whose KV was never
computed), appends the new input, and makes all of it the prompt, so only
the new tokens (and that one) are computed. A non-resumable request with the
same id ends the input: the session finishes after its running turn, or is
aborted at once while it waits. As vLLM 0.33's streaming input does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import RequestRejected
from llmsched.core.kv.manager import KVCacheManager
from llmsched.core.request import Request, RequestStatus, TurnEnd

_WAITING = RequestStatus.WAITING
_WAITING_FOR_INPUT = RequestStatus.WAITING_FOR_INPUT


class SessionHost(Protocol):
    """What session bookkeeping uses of the scheduler that owns it."""

    @property
    def config(self) -> SchedulerConfig: ...

    @property
    def kv(self) -> KVCacheManager: ...

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]: ...

    def requeue_holding(self, req: Request) -> None: ...


class Sessions:
    """The scheduler's session bookkeeping: inputs in, turns ended, resumes."""

    __slots__ = ("num_waiting_for_input", "sched")

    def __init__(self, sched: SessionHost) -> None:
        self.sched = sched
        # Sessions waiting for input: in a queue, holding blocks and a
        # sequence slot, but nothing to run (not "unfinished" work).
        self.num_waiting_for_input = 0

    def add_input(self, session: Request, update: Request) -> None:
        """``update`` arrived under an existing session's id: queue it, resume, or end the input."""
        if session.input_queue is None:
            raise RequestRejected(
                f"request id {session.request_id!r} is already in use by an unfinished request"
            )
        if None in session.input_queue:
            # vLLM queues it behind the end and never applies it: say so instead.
            raise RequestRejected(f"session {session.request_id!r}: its input already ended")
        if update.resumable:
            self._check_fits(session, update)
        if session.status is not _WAITING_FOR_INPUT:
            session.input_queue.append(update if update.resumable else None)
        elif update.resumable:
            self.resume(session, update)
        else:
            self.sched.finish_requests(session.request_id, RequestStatus.FINISHED_ABORTED)

    def _check_fits(self, session: Request, update: Request) -> None:
        """Reject an input that could never run: the session would outgrow max_model_len."""
        if not update.prompt_token_ids:
            raise RequestRejected(f"session {session.request_id!r}: the new input is empty")
        queued = sum(len(u.prompt_token_ids) for u in session.input_queue or () if u is not None)
        total = session.num_tokens + queued + len(update.prompt_token_ids)
        max_len = self.sched.config.max_model_len
        if total >= max_len:
            raise RequestRejected(
                f"session {session.request_id!r}: with this input it would hold {total} tokens "
                f"but max_model_len is {max_len}"
            )

    def on_stopped(self, req: Request) -> bool:
        """A session's turn stopped; True if it is finished for good (else it stays, holding blocks)."""
        req.turn_end = TurnEnd(req.status, req.stop_reason, req.token_ids[req.num_prompt_tokens :])
        # Work of this turn still in flight (async mode) is dropped: the next
        # turn recomputes from the last materialized position.
        req.num_computed_tokens -= req.num_output_placeholders
        req.spec_token_ids = []
        req.drop_stale_output = True
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        queue = req.input_queue
        if queue:
            update = queue.popleft()
            if update is None:
                return True
            self.resume(req, update)
        else:
            req.status = _WAITING_FOR_INPUT
            self.num_waiting_for_input += 1
        return False

    def resume(self, session: Request, update: Request) -> None:
        """Extend the session with ``update``'s input and make it ready to run."""
        keep = session.num_tokens - 1
        tokens = session.token_ids
        # Blocks registered lazily are hashed from these tokens: before they change.
        self.sched.kv.settle(session)
        del tokens[keep:]
        bs = self.sched.config.block_size
        del session.block_hashes[keep // bs :]
        tokens.extend(update.prompt_token_ids)
        session.prompt_token_ids = list(tokens)
        session.num_prompt_tokens = session.num_tokens = len(tokens)
        session.sampling_params = update.sampling_params
        session.stop_reason = None
        session.max_tokens = update.max_tokens
        session.min_tokens = update.min_tokens
        session.stop_length = min(session.num_tokens + update.max_tokens, self.sched.config.max_model_len)
        was_waiting = session.status is _WAITING_FOR_INPUT
        if was_waiting:
            self.num_waiting_for_input -= 1
        session.status = _WAITING
        if session.arrival_time != update.arrival_time:
            session.arrival_time = update.arrival_time
            if was_waiting:
                # Its place in a priority queue depends on the arrival time.
                self.sched.requeue_holding(session)

    def forget(self, req: Request) -> None:
        """A session left the scheduler (aborted or finished)."""
        if req.status is _WAITING_FOR_INPUT:
            self.num_waiting_for_input -= 1
