"""AsyncEngine.generate over an async iterator of StreamingInput, on the embedded model's engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmsched.core import SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.sessions import StreamingInput
from llmsched.server.async_engine import AsyncEngine
from llmsched.server.engine_messages import Add, OutputDelta
from llmsched.server.request_stream import RequestRejectedByEngine
from llmsched.server.thread_backend import ThreadBackend

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
def llm(use_embedded: Path) -> LLMEngine:
    """A fresh engine per test: stopping the AsyncEngine closes it."""
    return LLMEngine(EngineArgs(model=None, num_gpu_blocks_override=64, max_model_len=128))


async def started(llm: LLMEngine) -> AsyncEngine:
    engine = AsyncEngine(ThreadBackend(llm))
    engine.start()
    return engine


async def inputs(*items: StreamingInput, gap: asyncio.Event | None = None) -> AsyncIterator[StreamingInput]:
    """Yields ``items``; with ``gap``, waits for it before each input after the first."""
    for i, item in enumerate(items):
        if i and gap is not None:
            await gap.wait()
            gap.clear()
        yield item


async def wait_free(engine: AsyncEngine, expected: int) -> None:
    for _ in range(500):
        if engine.snapshot.num_free_blocks == expected:
            return
        await asyncio.sleep(0.01)
    assert engine.snapshot.num_free_blocks == expected


def test_generate_streams_each_turn_then_ends_with_the_inputs(llm: LLMEngine) -> None:
    async def main() -> list[OutputDelta]:
        engine = await started(llm)
        free0 = llm.scheduler.kv.num_free_blocks
        gap = asyncio.Event()
        feed = inputs(
            StreamingInput({"prompt_token_ids": list(range(40, 60))}),
            StreamingInput([70, 71, 72], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)),
            gap=gap,
        )
        outs = []
        async for out in engine.generate(feed, GREEDY, "s1"):
            outs.append(out)
            if out.finish_reason is not None and not out.finished:
                assert engine.snapshot.num_free_blocks < free0  # KV kept between turns
                gap.set()
        await wait_free(engine, free0)
        await engine.stop()
        return outs

    outs = asyncio.run(main())
    ends = [i for i, o in enumerate(outs) if o.finish_reason is not None]
    assert len(ends) == 2 and ends[-1] == len(outs) - 1
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    first_turn = [t for o in outs[: ends[0] + 1] for t in o.token_ids]
    second_turn = [t for o in outs[ends[0] + 1 :] for t in o.token_ids]
    assert len(first_turn) == 4 and len(second_turn) == 2


def test_a_refused_input_ends_the_session_with_its_error_and_frees_it(llm: LLMEngine) -> None:
    async def main() -> None:
        engine = await started(llm)
        free0 = llm.scheduler.kv.num_free_blocks
        feed = inputs(StreamingInput([40] * 10), StreamingInput([5] * 200))
        with pytest.raises(RequestRejectedByEngine, match="max_model_len"):
            async for _ in engine.generate(feed, GREEDY, "s2"):
                pass
        await wait_free(engine, free0)
        # Text needs a tokenizer; none given here.
        with pytest.raises(RequestRejectedByEngine, match="needs a tokenizer"):
            async for _ in engine.generate(inputs(StreamingInput("hi")), GREEDY, "s3"):
                pass
        await engine.stop()

    asyncio.run(main())


def test_leaving_the_outputs_early_aborts_the_session(llm: LLMEngine) -> None:
    async def main() -> None:
        engine = await started(llm)
        free0 = llm.scheduler.kv.num_free_blocks
        long = SamplingParams(max_tokens=100, ignore_eos=True)
        outs = engine.generate(inputs(StreamingInput([40] * 20)), long, "s4")
        async with contextlib.aclosing(outs):
            async for out in outs:
                assert out.token_ids
                break
        await wait_free(engine, free0)
        assert engine.num_streams == 0
        await engine.stop()

    asyncio.run(main())


def test_a_late_input_never_reopens_an_ended_session(llm: LLMEngine) -> None:
    async def main() -> None:
        engine = await started(llm)
        free0 = llm.scheduler.kv.num_free_blocks
        # An input that was on its way when its session ended (here: never opened).
        engine.backend.send(Add("gone", [1, 2, 3], None, time.monotonic(), resumable=True, continues=True))
        # Commands are served in order: once this request is done, the late input was handled.
        stream = engine.submit("after", [40] * 5, GREEDY)
        await stream.accepted
        while not stream.finished:
            await stream.next_batch()
        await wait_free(engine, free0)
        assert not llm.has_unfinished_requests()
        await engine.stop()

    asyncio.run(main())
