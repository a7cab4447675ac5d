"""AsyncEngine and the engine loop on a thread, over a deterministic fake executor.

One scheduler for all submitters, aborts that free KV before the next step,
the admission window, queue limits, and failures that stay with their request.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from llmsched.core import ModelRunnerOutput, SamplingParams, SchedulerOutput
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.server.admission import REASON_REQUESTS, REASON_TOKENS, Overloaded
from llmsched.server.async_engine import AsyncEngine
from llmsched.server.engine_messages import OutputDelta
from llmsched.server.request_stream import EngineError, RequestRejectedByEngine, RequestStream
from llmsched.server.thread_backend import ThreadBackend

TIMEOUT = 20.0


class GatedExecutor:
    """Wraps the fake executor: each step waits for ``gate``; ``fail_next`` makes one step raise.

    ``pause_after`` closes the gate once that many more steps have run.
    """

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False
        self.pause_after: int | None = None
        self._pause_lock = threading.Lock()
        self.num_gpu_blocks = inner.num_gpu_blocks  # type: ignore[attr-defined]
        self.max_model_len = inner.max_model_len  # type: ignore[attr-defined]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Block until the gate opens, then run (or fail) the step."""
        assert self.gate.wait(TIMEOUT)
        with self._pause_lock:
            if self.pause_after is not None:
                self.pause_after -= 1
                if self.pause_after <= 0:
                    self.pause_after = None
                    self.gate.clear()
        if self.fail_next and so.scheduled:
            self.fail_next = False
            raise RuntimeError("injected executor failure")
        return self.inner.execute(so)  # type: ignore[attr-defined]

    def open_for_good(self) -> None:
        """Open the gate and cancel a pending pause (it may not have closed the gate yet)."""
        with self._pause_lock:
            self.pause_after = None
            self.gate.set()

    def close(self) -> None:
        """Close the wrapped executor."""
        self.inner.close()  # type: ignore[attr-defined]


def make_engine(
    model_dir: Path,
    fake_factory: Callable,
    num_gpu_blocks: int = 64,
    scripts: dict | None = None,
    admission_window_ms: float = 0.0,
    **kwargs: object,
) -> tuple[AsyncEngine, GatedExecutor]:
    """An AsyncEngine over a gated fake executor on a thread (not started); ``scripts`` go to FakeExecutor."""
    made: list[GatedExecutor] = []
    inner_factory = fake_factory(num_gpu_blocks=num_gpu_blocks, max_model_len=512, scripts=scripts or {})

    def factory(model: Path, **kw: object) -> GatedExecutor:
        ex = GatedExecutor(inner_factory(model, **kw))
        made.append(ex)
        return ex

    llm = LLMEngine(EngineArgs(model=str(model_dir), max_num_batched_tokens=512), executor_factory=factory)
    backend = ThreadBackend(llm, admission_window_ms=admission_window_ms)
    return AsyncEngine(backend, **kwargs), made[0]  # type: ignore[arg-type]


def llm_of(engine: AsyncEngine) -> LLMEngine:
    """The LLMEngine behind a thread backend."""
    return engine.backend.engine  # type: ignore[attr-defined]


def records(engine: AsyncEngine) -> list:
    """The engine loop's step records."""
    return engine.backend.loop.step_log.last(10_000)  # type: ignore[attr-defined]


async def collect(stream: RequestStream, outs: list[OutputDelta] | None = None) -> list[OutputDelta]:
    """Every output of a stream until it finishes (after ``outs``, already taken)."""
    outs = list(outs or [])
    while not outs or not outs[-1].finished:
        outs.extend(await asyncio.wait_for(stream.next_batch(), TIMEOUT))
    return outs


def text_of(outs: list[OutputDelta]) -> str:
    """The concatenated delta text."""
    return "".join(o.text for o in outs)


def params(n: int) -> SamplingParams:
    """Greedy, exactly n tokens."""
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)


def test_concurrent_submitters_share_one_scheduler(byte_model_dir: Path, fake_factory: Callable) -> None:
    async def main() -> None:
        engine, ex = make_engine(byte_model_dir, fake_factory)
        ex.gate.clear()
        engine.start()
        try:
            # Held at the gate, the first step cannot finish before all eight are queued.
            streams = [engine.submit(f"r{i}", list(b"abc"), params(4)) for i in range(8)]
            await asyncio.sleep(0.05)
            ex.gate.set()
            results = await asyncio.gather(*(collect(s) for s in streams))
            for outs in results:
                # The fake samples the next byte: abc -> defg.
                assert text_of(outs) == "defg"
                assert outs[-1].finish_reason == "length"
            admitted = [r.admitted for r in records(engine)]
            assert sorted(rid for step in admitted for rid in step) == sorted(f"r{i}" for i in range(8))
            assert engine.admission.num_requests == 0 and engine.admission.num_queued_tokens == 0
        finally:
            await engine.stop()

    asyncio.run(main())


def test_abort_frees_kv_blocks_before_the_next_step(byte_model_dir: Path, fake_factory: Callable) -> None:
    async def main() -> None:
        engine, ex = make_engine(byte_model_dir, fake_factory)
        kv = llm_of(engine).scheduler.kv
        free_at_start = kv.num_free_blocks
        engine.start()
        try:
            # Three steps run, then the engine blocks inside the fourth.
            ex.pause_after = 4
            stream = engine.submit("long", list(b"x" * 40), params(400))
            await stream.accepted
            first = await asyncio.wait_for(stream.next_batch(), TIMEOUT)
            assert first and not first[-1].finished
            engine.abort("long")
            await asyncio.sleep(0.05)
            ex.gate.set()
            outs = await collect(stream, first)
            assert outs[-1].finish_reason == "abort"
            assert kv.num_free_blocks == free_at_start
            # An abort is logged with the next step scheduled after it. With
            # async scheduling the step after the blocked one may already be
            # scheduled (with "long") when the abort lands, and then nothing
            # else runs: a later request makes that next step.
            ex.open_for_good()
            later = engine.submit("later", list(b"y" * 8), params(2))
            await later.accepted
            assert (await collect(later))[-1].finished
            recs = records(engine)
            abort_step = next(r for r in recs if "long" in r.aborted)
            # The step right after the abort no longer schedules it.
            assert all(
                "long" not in (e.request_id for e in r.trace.entries)
                for r in recs
                if r.step >= abort_step.step
            )
            assert engine.num_streams == 0 and engine.admission.num_requests == 0
        finally:
            await engine.stop()

    asyncio.run(main())


def test_admission_window_admits_a_burst_in_one_step(byte_model_dir: Path, fake_factory: Callable) -> None:
    async def main() -> None:
        engine, _ = make_engine(byte_model_dir, fake_factory, admission_window_ms=800)
        engine.start()
        try:
            t0 = time.monotonic()
            streams = []
            for i in range(5):
                streams.append(engine.submit(f"b{i}", list(b"hello"), params(2)))
                await asyncio.sleep(0.03)
            await asyncio.gather(*(collect(s) for s in streams))
            assert time.monotonic() - t0 >= 0.8
            admitting = [r for r in records(engine) if r.admitted]
            assert len(admitting) == 1
            assert sorted(admitting[0].admitted) == [f"b{i}" for i in range(5)]
        finally:
            await engine.stop()

    asyncio.run(main())


def test_admission_window_never_holds_running_requests(byte_model_dir: Path, fake_factory: Callable) -> None:
    async def main() -> None:
        engine, _ = make_engine(byte_model_dir, fake_factory, admission_window_ms=300)
        engine.start()
        try:
            a = engine.submit("a", list(b"abc"), params(30))
            await a.accepted
            first = await a.next_batch()
            b = engine.submit("b", list(b"abc"), params(2))
            outs_a = await collect(a, first)
            assert outs_a[-1].finish_reason == "length"
            # a ran to its end while b was still held by the window.
            assert not b.accepted.done()
            await collect(b)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_queue_limits_refuse_with_the_reason_and_recover(
    byte_model_dir: Path, fake_factory: Callable
) -> None:
    async def main() -> None:
        seen: list[str] = []

        class Observer:
            def on_output(self, *a: object) -> None:
                return None

            def on_rejected(self, reason: str) -> None:
                seen.append(reason)

            def on_snapshot(self, *a: object) -> None:
                return None

        engine, ex = make_engine(
            byte_model_dir,
            fake_factory,
            max_num_queued_requests=2,
            max_num_queued_tokens=15,
            observer=Observer(),
        )
        ex.gate.clear()
        engine.start()
        try:
            s1 = engine.submit("q1", list(b"0123456789"), params(3))
            with pytest.raises(Overloaded) as tokens_full:
                engine.submit("q2", list(b"0123456789"), params(3))
            assert tokens_full.value.reason == REASON_TOKENS and "15" in str(tokens_full.value)
            s2 = engine.submit("q3", list(b"abc"), params(3))
            with pytest.raises(Overloaded) as reqs_full:
                engine.submit("q4", list(b"abc"), params(3))
            assert reqs_full.value.reason == REASON_REQUESTS
            assert seen == [REASON_TOKENS, REASON_REQUESTS]
            assert engine.num_streams == 2
            ex.gate.set()
            await collect(s1)
            await collect(s2)
            assert (engine.admission.num_requests, engine.admission.num_queued_tokens) == (0, 0)
            await collect(engine.submit("q5", list(b"abc"), params(3)))
        finally:
            await engine.stop()

    asyncio.run(main())


def test_a_scheduler_rejection_reaches_the_submitter(byte_model_dir: Path, fake_factory: Callable) -> None:
    async def main() -> None:
        engine, _ = make_engine(byte_model_dir, fake_factory, num_gpu_blocks=8)
        engine.start()
        try:
            # 7 usable blocks of 16 tokens cannot hold 100 + 50 tokens.
            stream = engine.submit("huge", list(b"y" * 100), params(50))
            with pytest.raises(RequestRejectedByEngine, match="KV blocks"):
                await asyncio.wait_for(stream.accepted, TIMEOUT)
            assert engine.admission.num_requests == 0 and engine.admission.num_queued_tokens == 0
        finally:
            await engine.stop()

    asyncio.run(main())


def test_an_engine_failure_fails_its_requests_and_the_engine_serves_on(
    byte_model_dir: Path, fake_factory: Callable
) -> None:
    async def main() -> None:
        engine, ex = make_engine(byte_model_dir, fake_factory)
        ex.fail_next = True
        engine.start()
        try:
            stream = engine.submit("doomed", list(b"abc"), params(5))
            with pytest.raises(EngineError, match="injected"):
                await collect(stream)
            assert engine.is_running
            assert llm_of(engine).scheduler.kv.usage == 0.0
            outs = await collect(engine.submit("fine", list(b"abc"), params(3)))
            assert text_of(outs) == "def"
        finally:
            await engine.stop()

    asyncio.run(main())


def test_a_token_outside_the_vocabulary_fails_only_its_request(
    byte_model_dir: Path, fake_factory: Callable
) -> None:
    async def main() -> None:
        # Two good tokens, then one no vocabulary has (as NaN logits can produce).
        engine, ex = make_engine(byte_model_dir, fake_factory, scripts={tuple(b"bad"): [65, 66, 10**6]})
        ex.gate.clear()
        engine.start()
        try:
            bad = engine.submit("bad", list(b"bad"), params(6))
            good = engine.submit("good", list(b"abc"), params(6))
            await asyncio.sleep(0.05)
            ex.gate.set()
            with pytest.raises(EngineError, match="outside its vocabulary"):
                await collect(bad)
            assert text_of(await collect(good)) == "defghi"
            assert engine.is_running and llm_of(engine).scheduler.kv.usage == 0.0
            assert "bad" in {rid for r in records(engine) for rid in r.aborted}
        finally:
            await engine.stop()

    asyncio.run(main())


def test_stop_fails_what_is_in_flight(byte_model_dir: Path, fake_factory: Callable) -> None:
    async def main() -> None:
        engine, ex = make_engine(byte_model_dir, fake_factory)
        ex.pause_after = 3
        engine.start()
        stream = engine.submit("pending", list(b"abc"), params(300))
        await stream.accepted
        stopping = asyncio.ensure_future(engine.stop())
        await asyncio.sleep(0.05)
        ex.gate.set()
        await asyncio.wait_for(stopping, TIMEOUT)
        with pytest.raises(EngineError, match="shutting down"):
            await collect(stream)
        assert not engine.is_running

    asyncio.run(main())
