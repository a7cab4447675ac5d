"""A streaming-input session driven by an async iterator of inputs, as vLLM's ``AsyncLLM.generate`` takes one.

Each ``StreamingInput`` becomes the session's next turn; the session's
output deltas are yielded as they stream. A turn's last delta has its
``finish_reason`` set while ``finished`` stays False; the delta with
``finished=True`` ends the session, which happens after the turn that runs
when the iterator is exhausted. Leaving early (the consumer stops, an input
is refused, the iterator raises) aborts the session and frees its KV blocks. With ``on_rejected`` a later
input the engine refuses (past max_model_len, say) is reported to it and
the session goes on, as the engine left it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.sessions import StreamingInput
from llmsched.server.engine_messages import OutputDelta
from llmsched.server.request_stream import RequestRejectedByEngine, RequestStream

__all__ = ["StreamingInput", "input_token_ids", "session_outputs"]

Tokenize = Callable[[str], list[int]]
# Told about a later input the engine refused; the session then goes on without it.
OnRejected = Callable[[RequestRejectedByEngine], Awaitable[None]]


class SessionEngine(Protocol):
    """What driving a session uses of ``AsyncEngine``."""

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        resumable: bool = False,
        **kwargs: Any,
    ) -> RequestStream: ...

    def submit_input(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> Awaitable[object]: ...

    def end_input(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> None: ...


def input_token_ids(request_id: str, prompt: object, tokenize: Tokenize | None) -> list[int]:
    """A StreamingInput's prompt as token ids; RequestRejectedByEngine names what is wrong."""
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if tokenize is None:
            raise RequestRejectedByEngine(f"session {request_id!r}: a text input needs a tokenizer")
        return tokenize(prompt)
    if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise RequestRejectedByEngine(
        f"session {request_id!r}: an input's prompt must be text, token ids, {{'prompt': ...}} "
        "or {'prompt_token_ids': [...]}"
    )


async def session_outputs(
    engine: SessionEngine,
    inputs: AsyncIterator[StreamingInput],
    params: SamplingParams,
    request_id: str,
    tokenize: Tokenize | None,
    submit_kwargs: Mapping[str, object],
    on_rejected: OnRejected | None = None,
) -> AsyncIterator[OutputDelta]:
    """The body of ``AsyncEngine.generate``."""
    it = aiter(inputs)
    first = await anext(it, None)
    if first is None:
        return
    ids = input_token_ids(request_id, first.prompt, tokenize)
    stream = engine.submit(request_id, ids, first.sampling_params or params, resumable=True, **submit_kwargs)  # type: ignore[arg-type]
    feeder: asyncio.Task | None = None
    try:
        await stream.accepted
        feeder = asyncio.create_task(_feed(engine, stream, it, tokenize, on_rejected))
        while True:
            for out in await stream.next_batch():
                yield out
                if out.finished:
                    return
    finally:
        if feeder is not None and not feeder.done():
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
        if not stream.finished:
            engine.abort(request_id)


async def _feed(
    engine: SessionEngine,
    stream: RequestStream,
    it: AsyncIterator[StreamingInput],
    tokenize: Tokenize | None,
    on_rejected: OnRejected | None,
) -> None:
    """Send the session's later inputs in order, each once the previous was accepted; then end its input."""
    rid = stream.request_id
    try:
        async for inp in it:
            if stream.finished:
                return
            try:
                ids = input_token_ids(rid, inp.prompt, tokenize)
                await engine.submit_input(rid, ids, inp.sampling_params)
            except RequestRejectedByEngine as e:
                if on_rejected is None:
                    raise
                await on_rejected(e)
        if not stream.finished:
            engine.end_input(rid)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a refused input or a failing iterator ends the session with that error
        stream.fail(e)
        engine.abort(rid)
