"""WebSocket /v1/sessions: one streaming-input session per connection.

The client sends JSON text messages: ``{"type": "input", "prompt": "..."}``
(or ``"prompt_token_ids": [...]``) with optional sampling fields
(``max_tokens``, default 16, ``temperature``, ``top_p``, ``seed``,
``stop_token_ids``, ``ignore_eos``, ...; a later input without them keeps
the session's), and ``{"type": "session.end"}`` to end the input. Each
input is the session's next turn; the KV of the turns before is kept.
The first input's ``model`` picks the model as in /v1/completions: a LoRA
adapter's name runs the whole session with that adapter; a later input may
repeat that name or leave ``model`` out, but not name another.

The server answers ``session.created`` (the session's id), then for each
turn ``output.delta`` messages (``text``, ``token_ids``) and a
``turn.done`` (``finish_reason``, ``stop_reason``, ``usage``), and after
the last turn ``session.done`` before closing. A malformed message gets an
``error`` message (``code``: invalid_json, invalid_input, unknown_event,
input_rejected) and the session goes on; an error the session cannot
survive (the engine failed, the server is overloaded or stopping) is sent
as ``error`` and the socket closes. When the client goes away, even mid-turn,
the session is aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import Field, ValidationError

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.lora_request import LoRARequest
from llmsched.server.admission import Overloaded
from llmsched.server.async_engine import EngineDead
from llmsched.server.engine_messages import OutputDelta
from llmsched.server.errors import APIError
from llmsched.server.prompts import NO_TOKENIZER, check_token_ids, encode
from llmsched.server.protocol import SamplingFields
from llmsched.server.request_stream import EngineError, RequestRejectedByEngine
from llmsched.server.sampling import build_sampling_params, check_common, check_prompt_len
from llmsched.server.session_stream import StreamingInput, session_outputs
from llmsched.server.state import ServerState

SESSIONS_PATH = "/v1/sessions"
# Fields of an input message that are not sampling fields.
_INPUT_KEYS = frozenset({"type", "prompt", "prompt_token_ids", "model"})
# WebSocket close codes: policy violation (refused), internal error, try again later.
CLOSE_REFUSED, CLOSE_ERROR, CLOSE_RETRY = 1008, 1011, 1013


class SessionInput(SamplingFields):
    """One ``input`` message of a session."""

    type: str = "input"
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = Field(16, ge=1)


class BadMessage(Exception):
    """A message the session cannot use; it is answered with an error and the session goes on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def session_router(state: ServerState) -> APIRouter:
    """The WebSocket session route over ``state``."""
    router = APIRouter()

    @router.websocket(SESSIONS_PATH)
    async def session_socket(ws: WebSocket) -> None:
        await ws.accept()
        await SessionSocket(state, ws).serve()

    return router


class SessionSocket:
    """One connection: reads inputs, runs them as one session, writes its outputs."""

    def __init__(self, state: ServerState, ws: WebSocket) -> None:
        self.state = state
        self.ws = ws
        self.request_id = state.engine.new_request_id("session")
        self._send_lock = asyncio.Lock()
        self._first = True
        # The sampling fields the inputs so far set: a later input that sets
        # some fields keeps the others (it would otherwise fall back to the
        # defaults, temperature 1.0 included, for every field it left out).
        self._sampling: dict = {}
        # The adapter the first input's ``model`` named (None: the base model), for all turns.
        self._lora: LoRARequest | None = None
        # Inputs sent whose turn has not ended yet, and the current turn's token count.
        self._turns_open = 0
        self._turn_tokens = 0
        self._turn_prompt_tokens: list[int] = []
        # The first input's request-wide fields (user, priority, cache_salt), read when it arrives.
        self._submit_options: dict[str, Any] = {}
        # Whether session.done went out: a session ended before any turn ran still gets one.
        self._done = False

    async def send(self, msg: dict[str, Any]) -> None:
        """Send one JSON message (outputs and errors come from two tasks)."""
        async with self._send_lock:
            await self.ws.send_text(json.dumps(msg))

    async def error(self, code: str, message: str) -> None:
        """Tell the client what was wrong with its message."""
        await self.send({"type": "error", "code": code, "error": message})

    async def serve(self) -> None:
        """Run the session until it ends, the client leaves, or an unrecoverable error."""
        engine = self.state.engine
        await self.send({"type": "session.created", "id": self.request_id, "model": self.state.model_name})
        # The first input's params are always given; the SamplingParams() default is never used.
        options = self._submit_options
        outputs = session_outputs(
            engine, self.inputs(), SamplingParams(), self.request_id, None, options, self.rejected
        )
        try:
            async with contextlib.aclosing(outputs) as outs:  # type: ignore[type-var]
                async for out in outs:
                    await self.on_output(out)
        except WebSocketDisconnect:
            return  # the client left: generate() aborted the session
        except (RequestRejectedByEngine, ValueError) as e:
            await self._close_with(CLOSE_REFUSED, "input_rejected", str(e))
            return
        except Overloaded as e:
            await self._close_with(CLOSE_RETRY, "overloaded", str(e))
            return
        except (EngineError, EngineDead) as e:
            await self._close_with(CLOSE_ERROR, "engine_error", str(e))
            return
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            if not self._done:
                # session.end before any input: no turn ran, so there is no finish reason.
                await self.send({"type": "session.done", "finish_reason": None})
            await self.ws.close()

    async def _close_with(self, code: int, error_code: str, message: str) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self.error(error_code, message)
            await self.ws.close(code)

    async def rejected(self, e: RequestRejectedByEngine) -> None:
        """The engine refused a later input; the session goes on as it was."""
        self._turns_open -= 1
        self._turn_prompt_tokens.pop()
        await self.error("input_rejected", str(e))

    async def on_output(self, out: OutputDelta) -> None:
        """Forward one output delta: text and tokens, then the turn's and the session's end."""
        if out.token_ids or out.text:
            self._turn_tokens += len(out.token_ids)
            await self.send({"type": "output.delta", "text": out.text, "token_ids": out.token_ids})
        if out.finish_reason is not None and self._turns_open > 0:
            self._turns_open -= 1
            prompt_tokens = self._turn_prompt_tokens.pop(0)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": self._turn_tokens}
            self._turn_tokens = 0
            await self.send(
                {
                    "type": "turn.done",
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                    "usage": usage,
                }
            )
        if out.finished:
            self._done = True
            await self.send({"type": "session.done", "finish_reason": out.finish_reason})

    async def inputs(self) -> AsyncIterator[StreamingInput]:
        """The session's inputs as the client sends them; ends with ``session.end``."""
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(msg.get("code", 1000))
            try:
                parsed = self.parse(msg)
            except BadMessage as e:
                await self.error(e.code, e.message)
                continue
            if parsed is None:
                return
            self._turns_open += 1
            self._turn_prompt_tokens.append(len(parsed.prompt))  # type: ignore[arg-type]
            yield parsed

    def parse(self, msg: dict[str, Any]) -> StreamingInput | None:
        """One message as the session's next input (None: the input ends); BadMessage says what is wrong."""
        text = msg.get("text")
        if text is None:
            raise BadMessage("invalid_json", "send JSON objects as text messages")
        try:
            body = json.loads(text)
        except ValueError as e:
            raise BadMessage("invalid_json", f"the message is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadMessage("invalid_json", "a message must be a JSON object")
        kind = body.get("type", "input")
        if kind == "session.end":
            return None
        if kind != "input":
            raise BadMessage("unknown_event", f"unknown message type {kind!r} (input, session.end)")
        try:
            return self._input(SessionInput.model_validate(body))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise BadMessage("invalid_input", f"{where}: {err['msg']}") from None
        except APIError as e:
            raise BadMessage("invalid_input", e.message) from None

    def _input(self, req: SessionInput) -> StreamingInput:
        state = self.state
        state.check_model(req.model)
        lora = state.lora_for(req.model)
        if not self._first and req.model is not None and lora != self._lora:
            running = self._lora.lora_name if self._lora is not None else state.model_name
            raise APIError(
                400, f"the session runs {running!r}; an input cannot switch it to {req.model!r}", "model"
            )
        if (req.prompt is None) == (req.prompt_token_ids is None):
            raise APIError(400, "an input needs exactly one of 'prompt' and 'prompt_token_ids'", "prompt")
        if req.prompt is not None:
            if state.tokenizer is None:
                raise APIError(400, f"a text prompt {NO_TOKENIZER}; send prompt_token_ids", "prompt")
            ids = encode(state.tokenizer, req.prompt, add_special_tokens=self._first, param="prompt")
        else:
            ids = list(req.prompt_token_ids or ())
            check_token_ids(ids, state.vocab_size, "prompt_token_ids")
        if not ids:
            raise APIError(400, "the input is empty", "prompt")
        if self._first:
            check_prompt_len(len(ids), state.limits, "prompt")
        params = None
        fields = {k: getattr(req, k) for k in req.model_fields_set - _INPUT_KEYS}
        if self._first or fields:
            self._sampling.update(fields)
            if not self._first:
                req = SessionInput.model_validate({**self._sampling, "prompt_token_ids": ids})
            params = self._params(req)
        if self._first:
            self._lora = lora
            self._submit_options.update(
                tenant=req.user,
                priority=req.priority,
                cache_salt=req.cache_salt,
                lora_request=lora,
            )
        self._first = False
        return StreamingInput(ids, params)

    def _params(self, req: SessionInput) -> SamplingParams:
        check_common(req)
        if req.stop:
            raise APIError(400, "stop strings are not supported in a session; use stop_token_ids", "stop")
        if req.n not in (None, 1):
            raise APIError(400, "n must be 1 in a session", "n")
        if req.response_format is not None or req.structured_outputs is not None:
            raise APIError(400, "structured outputs are not supported in a session", "structured_outputs")
        return build_sampling_params(req, max_tokens=req.max_tokens, logprobs=None, limits=self.state.limits)
