"""One generation request from submission to the last byte, streamed or not, for both endpoints."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial

from starlette.responses import Response

from llmsched.core.sampling_params import SamplingParams
from llmsched.server.admission import Overloaded
from llmsched.server.async_engine import EngineDead
from llmsched.server.errors import APIError, sse_error
from llmsched.server.fanout import generate_n
from llmsched.server.protocol import SamplingFields, StreamOptions
from llmsched.server.request_stream import (
    EngineError,
    RequestRejectedByEngine,
    RequestStream,
    RequestTimedOut,
)
from llmsched.server.responses import DONE, Delta, Formatter, sse
from llmsched.server.state import ServerState
from llmsched.server.streaming import DeferredJSONResponse, EventStreamResponse


async def generate(
    state: ServerState,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    body: SamplingFields,
    formatter: Formatter,
    prompt_param: str,
    images: list | None = None,
) -> Response:
    """Queue the request, wait until the scheduler accepted it, then answer (SSE or JSON)."""
    if state.tokenizer is None or (body.model_extra or {}).get("return_token_ids") is True:
        formatter.include_token_ids(prompt_token_ids)
    if getattr(body, "echo", False):
        formatter.echo = echo_text(state, body, prompt_token_ids)
    n = body.n or 1
    if n > 1 and images:
        raise APIError(400, "n > 1 is not supported with images; send one request per choice", "n")
    if n > 1:
        forks = [formatter.fork(i) for i in range(n)]
        return await generate_n(state, request_id, prompt_token_ids, params, body, forks, prompt_param)
    engine = state.engine
    retry = {"Retry-After": str(state.args.retry_after_s)}
    try:
        stream = engine.submit(
            request_id,
            prompt_token_ids,
            params,
            priority=body.priority,
            cache_salt=body.cache_salt,
            tenant=body.user,
            kv_transfer_params=body.kv_transfer_params,
            lora_request=state.lora_for(body.model),
            images=images,
        )
    except Overloaded as e:
        raise APIError(503, str(e), headers=retry) from None
    except EngineDead as e:
        raise APIError(503, f"the engine is not serving: {e}", headers=retry) from None
    try:
        await stream.accepted
    except RequestRejectedByEngine as e:
        # A constraint the engine could not build names itself in the message.
        param = "structured_outputs" if "structured_outputs" in str(e) else prompt_param
        raise APIError(400, str(e), param) from None
    except RequestTimedOut as e:
        raise APIError(e.status, str(e)) from None
    except EngineError as e:
        raise APIError(503, str(e), headers=retry) from None
    except asyncio.CancelledError:
        engine.abort(request_id)
        raise
    abort = partial(engine.abort, request_id)
    if body.stream:
        return EventStreamResponse(_events(stream, formatter, body.stream_options, abort), abort)
    return DeferredJSONResponse(_final(stream, formatter), abort)


def echo_text(state: ServerState, body: SamplingFields, prompt_token_ids: list[int]) -> str:
    """The prompt as completions' echo shows it: the text given, or the ids decoded."""
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if state.tokenizer is None:
        return ""
    return state.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)


async def _events(
    stream: RequestStream, fmt: Formatter, options: StreamOptions | None, abort: partial
) -> AsyncIterator[bytes]:
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    finished = False
    try:
        for chunk in fmt.first_chunks():
            if include_usage:
                chunk["usage"] = fmt.usage() if continuous else None
            yield sse(chunk)
        while not finished:
            outs = await stream.next_batch()
            finished = outs[-1].finished
            d = Delta()
            d.add(outs)
            chunk = fmt.chunk(d)
            if chunk is not None:
                if include_usage:
                    chunk["usage"] = fmt.usage() if continuous else None
                yield sse(chunk)
        if include_usage:
            yield sse(fmt.usage_chunk())
        yield DONE
    except EngineError as e:
        # The status line went out long ago: the error travels as an event.
        yield sse_error(e.status, str(e))
        yield DONE
    finally:
        if not finished:
            abort()


async def _final(stream: RequestStream, fmt: Formatter) -> dict:
    d = Delta()
    try:
        while True:
            outs = await stream.next_batch()
            d.add(outs)
            if outs[-1].finished:
                return fmt.final(d)
    except EngineError as e:
        raise APIError(e.status, str(e)) from None
