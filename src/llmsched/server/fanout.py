"""n > 1: one request forked into n sequences that share the prompt's KV blocks, answered as n choices.

Each sequence is its own engine request (id ``{i}_{request id}``, as vLLM
names them), queued together, so the scheduler admits them in one step and
the prefix cache hands the later ones the first one's prompt blocks: the
prompt is computed once. With a seed, sequence i samples with seed + i (as
vLLM does), so the n choices differ and are reproducible. The naming and
the children's parameters are the engine's (``engine.parallel_sampling``,
which the offline API forks with too); this module streams the children
as choices.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.parallel_sampling import child_params, child_request_id
from llmsched.server.admission import Overloaded
from llmsched.server.async_engine import EngineDead
from llmsched.server.errors import APIError, sse_error
from llmsched.server.protocol import SamplingFields
from llmsched.server.request_stream import (
    EngineError,
    RequestRejectedByEngine,
    RequestStream,
    SequenceGroup,
)
from llmsched.server.responses import DONE, Delta, Formatter, sse, usage
from llmsched.server.state import ServerState
from llmsched.server.streaming import DeferredJSONResponse, EventStreamResponse


async def generate_n(
    state: ServerState,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    body: SamplingFields,
    formatters: list[Formatter],
    prompt_param: str,
) -> Response:
    """Queue the n sequences, wait until all were accepted, then answer (SSE or JSON)."""
    streams = _submit_all(state, request_id, prompt_token_ids, params, body, len(formatters))
    abort = _aborter(state, streams)
    try:
        await asyncio.gather(*(st.accepted for st in streams))
    except RequestRejectedByEngine as e:
        abort()
        raise APIError(400, str(e), prompt_param) from None
    except EngineError as e:
        abort()
        raise APIError(e.status if e.status != 500 else 503, str(e)) from None
    except asyncio.CancelledError:
        abort()
        raise
    if body.stream:
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        return EventStreamResponse(_events(streams, formatters, include_usage, abort), abort)
    return DeferredJSONResponse(_final(streams, formatters), abort)


def _submit_all(
    state: ServerState,
    request_id: str,
    ids: list[int],
    params: SamplingParams,
    body: SamplingFields,
    n: int,
) -> list[RequestStream]:
    engine = state.engine
    group = SequenceGroup(n)
    streams: list[RequestStream] = []
    try:
        for i in range(n):
            st = engine.submit(
                child_request_id(i, request_id),
                ids,
                child_params(params, i),
                priority=body.priority,
                cache_salt=body.cache_salt,
                tenant=body.user,
                lora_request=state.lora_for(body.model),
            )
            st.group = group
            streams.append(st)
    except (Overloaded, EngineDead) as e:
        _aborter(state, streams)()
        retry = {"Retry-After": str(state.args.retry_after_s)}
        raise APIError(503, str(e), headers=retry) from None
    return streams


def _aborter(state: ServerState, streams: list[RequestStream]) -> Callable[[], None]:
    def abort() -> None:
        for st in streams:
            if not st.finished:
                state.engine.abort(st.request_id)

    return abort


async def _final(streams: list[RequestStream], fmts: list[Formatter]) -> dict:
    deltas = [Delta() for _ in streams]
    try:
        for st, d in zip(streams, deltas):
            while True:
                outs = await st.next_batch()
                d.add(outs)
                if outs[-1].finished:
                    break
    except EngineError as e:
        raise APIError(e.status, str(e)) from None
    answers = [f.final(d) for f, d in zip(fmts, deltas)]
    out = answers[0]
    out["choices"] = [a["choices"][0] for a in answers]
    out["usage"] = _usage(fmts)
    return out


def _usage(fmts: list[Formatter]) -> dict:
    # The prompt is counted once, as vLLM counts it for n > 1.
    return usage(fmts[0].prompt_len, sum(f.num_tokens for f in fmts), fmts[0].num_cached)


async def _pump(i: int, st: RequestStream, queue: asyncio.Queue) -> None:
    try:
        while True:
            outs = await st.next_batch()
            await queue.put((i, outs, None))
            if outs[-1].finished:
                return
    except EngineError as e:
        await queue.put((i, None, e))


async def _events(
    streams: list[RequestStream], fmts: list[Formatter], include_usage: bool, abort: Callable[[], None]
) -> AsyncIterator[bytes]:
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, st, queue)) for i, st in enumerate(streams)]
    live = len(streams)
    try:
        for f in fmts:
            for chunk in f.first_chunks():
                yield sse(chunk)
        while live:
            i, outs, err = await queue.get()
            if err is not None:
                yield sse_error(err.status, str(err))
                break
            d = Delta()
            d.add(outs)
            live -= bool(outs[-1].finished)
            chunk = fmts[i].chunk(d)
            if chunk is not None:
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        else:
            if include_usage:
                last = fmts[0].usage_chunk()
                last["usage"] = _usage(fmts)
                yield sse(last)
        yield DONE
    finally:
        for t in tasks:
            t.cancel()
        abort()
