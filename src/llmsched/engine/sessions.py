"""Streaming-input sessions on the engine side: what a user sends and what the engine tracks.

A session is a request added with ``resumable=True``; later inputs under the
same id extend it and keep its KV (the scheduler's side is
``llmsched.core.session``). The engine keeps one RequestState for the whole
session, so the detokenizer, output tokens and metrics continue across
turns. Each turn's last output carries its ``finish_reason`` with
``finished=False`` (``RequestOutput.turn_finished`` is True); the output
with ``finished=True`` says the whole session ended. As in vLLM 0.33, a
session cannot use stop strings, FINAL_ONLY outputs or n > 1.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmsched.core.errors import RequestRejected
from llmsched.core.request import Request, RequestStatus
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.outputs import RequestOutput, RequestOutputKind

if TYPE_CHECKING:
    from llmsched.engine.llm_engine import LLMEngine
    from llmsched.engine.request_state import RequestState


@dataclass
class StreamingInput:
    """One input of a session: a prompt (text, {"prompt": ...} or {"prompt_token_ids": [...]}).

    ``sampling_params`` apply to the turn this input starts; None keeps the
    session's.
    """

    prompt: str | Mapping[str, Any] | Sequence[int]
    sampling_params: SamplingParams | None = None


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


def check_session_params(request_id: str, params: SamplingParams, output_kind: RequestOutputKind) -> None:
    """Reject what a session cannot do, naming the request."""
    if output_kind is RequestOutputKind.FINAL_ONLY:
        raise RequestRejected(
            f"session {request_id!r}: FINAL_ONLY outputs cannot stream a session's turns; "
            "use DELTA or CUMULATIVE"
        )
    if params.stop:
        raise RequestRejected(
            f"session {request_id!r}: stop strings are not supported with streaming input; use stop_token_ids"
        )
    if getattr(params, "n", 1) != 1:
        raise RequestRejected(f"session {request_id!r}: n must be 1 with streaming input")
    if params.structured_outputs is not None:
        raise RequestRejected(
            f"session {request_id!r}: structured outputs are not supported with streaming input"
        )
    if params.prompt_logprobs is not None:
        raise RequestRejected(
            f"session {request_id!r}: prompt_logprobs are not supported with streaming input"
        )


def add_input(
    engine: LLMEngine,
    st: RequestState,
    prompt: object,
    params: SamplingParams | None,
    arrival_time: float | None,
) -> None:
    """Queue a session's next input, or raise RequestRejected leaving the session as it was."""
    req = st.request
    rid = req.request_id
    session = st.session
    assert session is not None
    if session.input_ended:
        raise RequestRejected(f"session {rid!r}: its input already ended")
    if params is None:
        params = req.sampling_params
    elif not isinstance(params, SamplingParams):
        raise RequestRejected(
            f"request {rid!r}: sampling params must be llmsched.SamplingParams, not {type(params).__name__}"
        )
    check_session_params(rid, params, st.output_kind)
    if isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
        raise RequestRejected(f"session {rid!r}: a later input cannot carry multi_modal_data")
    text, ids = engine.process_prompt(rid, prompt)  # type: ignore[arg-type]
    update = Request(
        rid,
        ids,
        params,
        eos_token_ids=engine.eos_token_ids,
        priority=req.priority,
        arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        tenant=req.tenant,
        resumable=True,
    )
    was_waiting = req.status is RequestStatus.WAITING_FOR_INPUT
    engine.engine_core.add_request(update)
    if was_waiting:
        st.start_turn(text)
    else:
        session.pending_prompts.append(text)


def end_input(engine: LLMEngine, st: RequestState) -> RequestOutput | None:
    """End a session's input: it finishes after its running turn, or now (its final output) between turns."""
    req = st.request
    rid = req.request_id
    session = st.session
    if session is None:
        raise RequestRejected(f"request {rid!r} is not a streaming-input session")
    if session.input_ended:
        raise RequestRejected(f"session {rid!r}: its input already ended")
    engine.engine_core.add_request(Request(rid, (), req.sampling_params, resumable=False))
    session.input_ended = True
    if not req.is_finished:
        return None
    # It was waiting for input: the scheduler freed its blocks at once.
    st.metrics.finished_time = time.monotonic()
    return st.make_output(True, session.last_reason)
