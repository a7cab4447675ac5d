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
from llmsched.server.protocol import SamplingFields, StreamOptions
from llmsched.server.request_stream import EngineError, RequestRejectedByEngine, RequestStream
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
) -> Response:
    """Queue the request, wait until the scheduler accepted it, then answer (SSE or JSON)."""
    engine = state.engine
    retry = {"Retry-After": str(state.args.retry_after_s)}
    try:
        stream = engine.submit(
            request_id, prompt_token_ids, params, priority=body.priority, cache_salt=body.cache_salt
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
    except EngineError as e:
        raise APIError(503, str(e), headers=retry) from None
    except asyncio.CancelledError:
        engine.abort(request_id)
        raise
    abort = partial(engine.abort, request_id)
    if body.stream:
        return EventStreamResponse(_events(stream, formatter, body.stream_options, abort), abort)
    return DeferredJSONResponse(_final(stream, formatter), abort)


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
        yield sse_error(500, str(e))
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
        raise APIError(500, str(e)) from None
