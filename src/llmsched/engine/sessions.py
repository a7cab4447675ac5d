"""Streaming-input sessions on the engine side: what a user sends and how the engine takes it.

A session is a request added with ``resumable=True``; later inputs under the
same id extend it and keep its KV (the scheduler's side is
``llmsched.core.session``). The engine keeps one RequestState (with its
SessionState) for the whole session, so the detokenizer, output tokens and
metrics continue across turns. Each turn's last output carries its
``finish_reason`` with ``finished=False`` (``RequestOutput.turn_finished``
is True); the output with ``finished=True`` says the whole session ended. As in vLLM 0.33, a
session cannot use stop strings, FINAL_ONLY outputs or n > 1.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llmsched.core.errors import RequestRejected
from llmsched.core.request import Request, RequestStatus
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.engine_core import EngineCore
from llmsched.engine.outputs import RequestOutput, RequestOutputKind
from llmsched.engine.request_state import RequestState


@dataclass
class StreamingInput:
    """One input of a session: a prompt (text, {"prompt": ...} or {"prompt_token_ids": [...]}).

    ``sampling_params`` apply to the turn this input starts; None keeps the
    session's.
    """

    prompt: str | Mapping[str, Any] | Sequence[int]
    sampling_params: SamplingParams | None = None


class SessionEngine(Protocol):
    """What a session's inputs use of the engine: prompt processing and the core to queue them on."""

    @property
    def engine_core(self) -> EngineCore: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    def process_prompt(self, request_id: str, prompt: Any) -> tuple[str | None, list[int]]: ...


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
    engine: SessionEngine,
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
    text, ids = engine.process_prompt(rid, prompt)
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


def end_input(engine: SessionEngine, st: RequestState) -> RequestOutput | None:
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
