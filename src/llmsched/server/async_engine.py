"""The HTTP side of the engine: per-request streams, queue limits and metrics, on the event loop.

Threading model: the engine loop (``engine_loop.EngineLoop``) runs on its
own, in a separate process by default (``process_backend``) or on a thread
(``thread_backend``), and is the only code that touches the LLMEngine.
Handlers on the event loop never call into it: ``submit`` and ``abort``
send it commands, and it answers with one message per step carrying every
output of that step. Delivering a step costs the event loop one callback
however many requests it served, and HTTP work never runs inside a step.

Disconnects: ``abort`` reaches the engine loop at once; the loop aborts the
request and frees its KV blocks before it starts the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.lora_request import LoRARequest
from llmsched.server.admission import AdmissionControl, Overloaded
from llmsched.server.engine_loop import Command
from llmsched.server.engine_messages import (
    REJECTED,
    Abort,
    Acks,
    Add,
    Dead,
    EndInput,
    EngineInfo,
    EngineSnapshot,
    Failed,
    LoRAOp,
    LoRAReply,
    OutputDelta,
    Query,
    Reply,
    StepBatch,
)
from llmsched.server.request_stream import (
    EngineError,
    RequestRejectedByEngine,
    RequestStream,
    RequestTimedOut,
    ServerShuttingDown,
)
from llmsched.server.session_stream import OnRejected, StreamingInput, session_outputs

QUERY_TIMEOUT_S = 30.0
# Loading an adapter reads its folder in the engine loop.
LORA_TIMEOUT_S = 120.0


class Backend(Protocol):
    """Where the engine loop runs: ThreadBackend or ProcessBackend."""

    def info(self) -> EngineInfo:
        """The engine's facts."""
        ...

    def start(self, deliver: Callable[[object], None]) -> None:
        """Start; the loop's messages reach ``deliver`` on the calling event loop."""
        ...

    def send(self, cmd: Command) -> None:
        """Queue a command for the loop; safe from any thread."""
        ...

    async def stop(self) -> None:
        """Stop the loop and release the engine."""
        ...


class OutputObserver(Protocol):
    """Sees every output on the event loop before its handler does (the server's metrics)."""

    def on_output(self, stream: RequestStream, out: OutputDelta, token_time: float) -> None:
        """One delta of ``stream``; ``token_time`` is when its tokens were sampled."""
        ...

    def on_rejected(self, reason: str) -> None:
        """A request was refused by a queue limit (``reason`` is vLLM's label)."""
        ...

    def on_snapshot(self, snapshot: EngineSnapshot) -> None:
        """A new engine snapshot arrived (each one once)."""
        ...


class EngineDead(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class AsyncEngine:
    """Serves many concurrent requests from one engine loop."""

    def __init__(
        self,
        backend: Backend,
        *,
        max_num_queued_requests: int = 1024,
        max_num_queued_tokens: int | None = None,
        observer: OutputObserver | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        self.backend = backend
        self.request_timeout_s = request_timeout_s
        self.info = backend.info()
        self.admission = AdmissionControl(max_num_queued_requests, max_num_queued_tokens)
        self.observer = observer
        self.snapshot: EngineSnapshot = self.info.snapshot
        # Data parallelism: each rank's latest snapshot (rank 0's is also ``snapshot``).
        self.snapshots: dict[int, EngineSnapshot] = {0: self.info.snapshot}
        self._streams: dict[str, RequestStream] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._ids = itertools.count()
        self._started = False
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Start the engine loop; call from the event loop that will serve requests."""
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        self.backend.start(self._handle)
        self._started = True

    async def stop(self) -> None:
        """Stop the engine loop, failing whatever is still in flight."""
        if self._dead is None:
            self._dead = "the server is shutting down"
        await self.backend.stop()
        self._fail_streams(list(self._streams), "the server is shutting down")

    @property
    def is_running(self) -> bool:
        """True while the engine loop serves requests."""
        return self._started and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine loop stopped serving, or None."""
        return self._dead

    @property
    def num_streams(self) -> int:
        """Requests the server is tracking (accepted or awaiting acceptance)."""
        return len(self._streams)

    def new_request_id(self, prefix: str) -> str:
        """A request id unique within this server."""
        return f"{prefix}-{next(self._ids)}-{time.time_ns() % 10**9:09d}"

    # ---- requests ----------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        images: list | None = None,
        resumable: bool = False,
    ) -> RequestStream:
        """Queue a request; raises Overloaded past a queue limit, EngineDead if the engine stopped.

        Await ``stream.accepted`` before answering: it raises
        RequestRejectedByEngine when the scheduler refuses the request.
        ``resumable=True`` opens a streaming-input session (``submit_input``,
        ``end_input``; ``generate`` drives one from an async iterator).
        """
        if not self.is_running:
            raise EngineDead(self._dead or "the engine is not running")
        prompt_len = len(prompt_token_ids)
        try:
            self.admission.acquire(prompt_len)
        except Overloaded as e:
            if self.observer is not None:
                self.observer.on_rejected(e.reason)
            raise
        assert self._loop is not None
        now = time.monotonic()
        stream = RequestStream(request_id, prompt_len, now, self._loop.create_future())
        stream.max_tokens = params.max_tokens
        stream.tenant = tenant
        if resumable:
            stream.input_acks = deque()
        self._streams[request_id] = stream
        self.backend.send(
            Add(
                request_id,
                list(prompt_token_ids),
                params,
                now,
                priority,
                cache_salt,
                tenant=tenant,
                kv_transfer_params=kv_transfer_params,
                lora_request=lora_request,
                images=images,
                resumable=resumable,
            )
        )
        # A session lives as long as its client feeds it; the timeout bounds one-shot requests.
        if self.request_timeout_s is not None and not resumable:
            stream.timer = self._loop.call_later(self.request_timeout_s, self._time_out, request_id)
        return stream

    def submit_input(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> asyncio.Future:
        """Send an open session its next input; the future fails with RequestRejectedByEngine if refused.

        ``params`` None keeps the session's sampling params.
        """
        st = self._streams.get(request_id)
        if st is None or st.input_acks is None or st.finished:
            raise RequestRejectedByEngine(f"request {request_id!r} is not an open session")
        if not self.is_running:
            raise EngineDead(self._dead or "the engine is not running")
        assert self._loop is not None
        ack = self._loop.create_future()
        st.input_acks.append(ack)
        ids = list(prompt_token_ids)
        add = Add(request_id, ids, params, time.monotonic(), resumable=True, continues=True)  # type: ignore[arg-type]
        self.backend.send(add)
        return ack

    def end_input(self, request_id: str) -> None:
        """End a session's input: it finishes after its running turn. Safe from any thread."""
        self.backend.send(EndInput(request_id))

    def generate(
        self,
        inputs: AsyncIterator[StreamingInput],
        params: SamplingParams,
        request_id: str,
        *,
        tokenize: Callable[[str], list[int]] | None = None,
        on_rejected: OnRejected | None = None,
        **submit_kwargs: object,
    ) -> AsyncIterator[OutputDelta]:
        """Serve a session fed by ``inputs``; yields its output deltas (see ``server.session_stream``)."""
        return session_outputs(self, inputs, params, request_id, tokenize, submit_kwargs, on_rejected)

    def _time_out(self, request_id: str) -> None:
        st = self._streams.get(request_id)
        if st is None or st.finished:
            return
        st.timer = None
        # The stream stays tracked: the engine's abort output releases its queue slot.
        st.fail(RequestTimedOut(f"the request did not finish within {self.request_timeout_s:g} s"))
        self.abort(request_id)

    def drain(self) -> None:
        """Stop accepting requests (503 from now on); those in flight go on."""
        if self._dead is None:
            self._dead = "the server is shutting down"

    def abort_all(self, message: str = "the server is shutting down") -> int:
        """Abort every request in flight; each handler ends with a clean error. Returns how many."""
        live = [st for st in self._streams.values() if not st.finished]
        for st in live:
            st.fail(ServerShuttingDown(message))
            self.abort(st.request_id)
        return len(live)

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone); a no-op once it finished. Safe from any thread."""
        self.backend.send(Abort(request_id))

    async def steps(self, last: int, explain: bool = False, rank: int | None = None) -> list[dict]:
        """The engine loop's latest ``last`` step records (answered between two steps).

        With data parallelism each record names its ``rank``; ``rank`` keeps only that one's.
        """
        return await self._ask(lambda token: Query(token, last, explain, rank), QUERY_TIMEOUT_S)

    async def lora_op(self, *, load: LoRARequest | None = None, unload: int | None = None) -> str | None:
        """Load or unload an adapter in the engine (between two steps); the error message, or None."""
        return await self._ask(lambda token: LoRAOp(token, load, unload), LORA_TIMEOUT_S)

    async def _ask(self, message: Callable[[int], object], timeout_s: float) -> Any:
        """Send the engine loop a tokened message and await its answer."""
        if not self.is_running:
            raise EngineDead(self._dead or "the engine is not running")
        assert self._loop is not None
        token = next(self._tokens)
        fut = self._loop.create_future()
        self._queries[token] = fut
        self.backend.send(message(token))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._queries.pop(token, None)

    # ---- messages from the engine loop (event loop) -----------------------------

    def _handle(self, msg: object) -> None:
        if isinstance(msg, StepBatch):
            self._deliver(msg)
        elif isinstance(msg, Acks):
            self._deliver_acks(msg)
        elif isinstance(msg, Failed):
            self._fail_streams(msg.request_ids, msg.message)
        elif isinstance(msg, (Reply, LoRAReply)):
            fut = self._queries.get(msg.token)
            if fut is not None and not fut.done():
                fut.set_result(msg.steps if isinstance(msg, Reply) else msg.error)
        elif isinstance(msg, Dead):
            if self._dead is None:
                self._dead = msg.message
            self._fail_streams(list(self._streams), msg.message)
            for fut in self._queries.values():
                if not fut.done():
                    fut.set_exception(EngineDead(msg.message))

    def _deliver_acks(self, acks: Acks) -> None:
        streams = self._streams
        for rid, err in acks.items:
            st = streams.get(rid)
            if st is None:
                continue
            acks = st.input_acks
            if acks and st.accepted.done():
                # A session's later input: refusing it does not end the session.
                ack = acks.popleft()
                if not ack.done():
                    if err is None:
                        ack.set_result(None)
                    else:
                        ack.set_exception(RequestRejectedByEngine(err[1]))
                continue
            if err is None:
                if not st.accepted.done():
                    st.accepted.set_result(None)
                continue
            del streams[rid]
            self._release(st)
            kind, message = err
            st.fail(RequestRejectedByEngine(message) if kind == REJECTED else EngineError(message))

    def _deliver(self, batch: StepBatch) -> None:
        streams = self._streams
        admission = self.admission
        observer = self.observer
        if batch.snapshot is not None:
            self.snapshots[batch.snapshot.engine] = batch.snapshot
            if batch.snapshot.engine == 0:
                self.snapshot = batch.snapshot
            if observer is not None:
                observer.on_snapshot(batch.snapshot)
        token_time = batch.token_time
        for out in batch.outputs:
            st = streams.get(out.request_id)
            if st is None:
                continue
            st.rank = batch.rank
            if st.counts_as_queued and (out.token_ids or out.finished):
                st.counts_as_queued = False
                admission.started(st.prompt_len)
            if observer is not None:
                observer.on_output(st, out, token_time)
            if out.finish_reason is not None and not out.finished:
                st.turn_ended = True  # a session's turn
            st.put(out)
            if out.finished:
                del streams[out.request_id]
                st.end_timer()
                admission.release()

    def _fail_streams(self, request_ids: Sequence[str], message: str) -> None:
        for rid in request_ids:
            st = self._streams.pop(rid, None)
            if st is None:
                continue
            self._release(st)
            st.fail(EngineError(message))

    def _release(self, st: RequestStream) -> None:
        st.end_timer()
        if st.counts_as_queued:
            st.counts_as_queued = False
            self.admission.started(st.prompt_len)
        self.admission.release()
