"""The engine loop: drain commands, admit (after the admission window), step, report.

It owns the LLMEngine and is the only code that touches it; it runs on the
engine thread or as the main loop of the engine process, and talks to the
HTTP side only through ``submit`` (commands in, any thread) and ``emit``
(messages out). Between two steps it drains every queued command, so all
clients' requests reach the one scheduler, and an abort frees the
request's KV blocks before the next step.

Admission window: with a window of W ms, new requests are held out of the
scheduler until the oldest of them is W ms old, then queued together, so a
burst is admitted in one step. Running requests keep stepping meanwhile;
the window delays only the requests it holds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from llmsched.core.errors import RequestRejected
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.outputs import RequestOutputKind
from llmsched.server.engine_messages import (
    FAILED,
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
    Stop,
)
from llmsched.server.engine_stats import (
    attach_residency,
    cache_config_labels,
    drain_evictions,
    encoder_cache_figures,
    waiting_by_reason,
)
from llmsched.server.step_log import StepLog, StepRecord

log = logging.getLogger("llmsched.server")
# How often an otherwise idle loop looks whether a grammar finished compiling.
GRAMMAR_POLL_S = 0.002

Command = Add | Abort | EndInput | Query | LoRAOp | Stop
Emit = Callable[[object], None]


class EngineLoop:
    """Steps one LLMEngine for many remote submitters."""

    def __init__(
        self,
        engine: LLMEngine,
        emit: Emit,
        *,
        admission_window_ms: float = 0.0,
        trace_steps: int = 256,
        kv_metrics_sample: float = 0.0,
    ) -> None:
        self.engine = engine
        self.residency = attach_residency(engine, kv_metrics_sample)
        self._last_reported: object = None
        self.emit = emit
        self.window_s = admission_window_ms / 1000.0
        self.step_log = StepLog(trace_steps)
        if trace_steps:
            engine.scheduler.enable_trace()
        self._inbox: deque[Command] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._held: list[Add] = []
        self._live: set[str] = set()
        # Requests queued and aborted since the last step was scheduled, then
        # kept by the step they preceded until its record is written (with
        # async scheduling, when its output comes back one step later).
        self._added: list[str] = []
        self._aborted: list[str] = []
        self._marks: dict[int, tuple[list[str], list[str]]] = {}

    def info(self) -> EngineInfo:
        """The engine's facts for the HTTP side."""
        e = self.engine
        return EngineInfo(
            model_path=str(e.model_path),
            model_notice=e.model_notice,
            max_model_len=e.max_model_len,
            vocab_size=e.vocab_size,
            max_num_seqs=e.scheduler_config.max_num_seqs,
            scheduling_policy=e.scheduler_config.policy,
            generation_defaults=dict(e.generation_defaults),
            trace_steps=self.step_log.capacity,
            snapshot=self.snapshot(),
            cache_config=cache_config_labels(e),
            kv_cache_metrics=self.residency is not None,
            startup_log=[*e.batch_limits_log(), *threads_log(e), *e.startup_notes],
        )

    def submit(self, cmd: Command) -> None:
        """Queue a command for the loop; safe from any thread."""
        self._inbox.append(cmd)
        self._wake.set()

    def run(self) -> None:
        """Serve commands until Stop; a crash is reported as Dead, never raised."""
        core = self.engine.engine_core
        wake = self._wake
        try:
            while not self._stopping:
                if not self._inbox and not core.has_requests():
                    timeout = None
                    if self._held:
                        timeout = self._held[0].arrival_time + self.window_s - time.monotonic()
                    if timeout is None or timeout > 0:
                        wake.wait(timeout)
                elif not self._inbox and self.engine.waiting_only_for_grammars():
                    # Only compiling grammars hold requests: poll, woken early by new commands.
                    wake.wait(GRAMMAR_POLL_S)
                wake.clear()
                outputs: list[OutputDelta] = []
                acks = Acks()
                self._drain(acks, outputs)
                if self._stopping:
                    break
                self._release_held(acks)
                if acks.items:
                    self.emit(acks)
                batch = StepBatch(outputs)
                ran = self._step(batch) if core.has_requests() else False
                if ran or outputs:
                    batch.snapshot = self.snapshot()
                    self.emit(batch)
        except BaseException as e:  # the loop must never die silently
            log.exception("the engine loop failed")
            self.emit(Dead(f"the engine failed: {e}"))
            return
        self.emit(Dead("the server is shutting down"))

    # ---- commands ----------------------------------------------------------

    def _drain(self, acks: Acks, outputs: list[OutputDelta]) -> None:
        inbox = self._inbox
        aborts: list[str] = []
        while inbox:
            cmd = inbox.popleft()
            if isinstance(cmd, Add):
                if self.window_s > 0:
                    self._held.append(cmd)
                else:
                    self._add(cmd, acks)
            elif isinstance(cmd, Abort):
                held = next((a for a in self._held if a.request_id == cmd.request_id), None)
                if held is not None:
                    # Never queued yet: queue it so the abort takes the ordinary path.
                    self._held.remove(held)
                    self._add(held, acks)
                aborts.append(cmd.request_id)
            elif isinstance(cmd, EndInput):
                self._end_input(cmd, acks, outputs)
            elif isinstance(cmd, Query):
                steps = [r.to_json(cmd.explain) for r in self.step_log.last(cmd.last)]
                self.emit(Reply(cmd.token, steps))
            elif isinstance(cmd, LoRAOp):
                self.emit(LoRAReply(cmd.token, self._lora_op(cmd)))
            else:
                self._stopping = True
        if aborts:
            for out in self.engine.abort_request(aborts):
                self._live.discard(out.request_id)
                self._aborted.append(out.request_id)
                outputs.append(OutputDelta.of(out))

    def _lora_op(self, cmd: LoRAOp) -> str | None:
        """Load or unload an adapter in the engine; the error message, or None."""
        try:
            if cmd.load is not None:
                self.engine.add_lora(cmd.load)
            elif cmd.unload is not None:
                self.engine.remove_lora(cmd.unload)
        except ValueError as e:
            return str(e)
        return None

    def _release_held(self, acks: Acks) -> None:
        held = self._held
        if held and time.monotonic() >= held[0].arrival_time + self.window_s:
            for cmd in held:
                self._add(cmd, acks)
            held.clear()

    def _add(self, cmd: Add, acks: Acks) -> None:
        if cmd.continues and cmd.request_id not in self._live:
            # Its session ended (aborted, failed) while this input travelled.
            acks.items.append((cmd.request_id, (REJECTED, f"session {cmd.request_id!r} has ended")))
            return
        try:
            prompt: dict = {"prompt_token_ids": cmd.prompt_token_ids}
            if cmd.images:
                prompt["multi_modal_data"] = {"image": cmd.images}
            self.engine.add_request(
                cmd.request_id,
                prompt,
                cmd.params,
                arrival_time=cmd.arrival_time,
                priority=cmd.priority,
                output_kind=RequestOutputKind.DELTA,
                cache_salt=cmd.cache_salt,
                tenant=cmd.tenant,
                kv_transfer_params=cmd.kv_transfer_params,
                lora_request=cmd.lora_request,
                resumable=cmd.resumable,
            )
        except (RequestRejected, ValueError) as e:
            acks.items.append((cmd.request_id, (REJECTED, str(e))))
            return
        except Exception as e:  # a bug, not bad input: report it without stopping the loop
            log.exception("add_request failed for %s", cmd.request_id)
            acks.items.append((cmd.request_id, (FAILED, f"the engine could not queue the request: {e}")))
            return
        self._live.add(cmd.request_id)
        self._added.append(cmd.request_id)
        acks.items.append((cmd.request_id, None))

    def _end_input(self, cmd: EndInput, acks: Acks, outputs: list[OutputDelta]) -> None:
        # Adds still held by the admission window go first, keeping the session's order.
        if any(a.request_id == cmd.request_id for a in self._held):
            self._held, held = [], self._held
            for add in held:
                self._add(add, acks)
        try:
            ended = self.engine.end_session(cmd.request_id)
        except RequestRejected:
            return  # already finished (aborted, failed): nothing to end
        for out in ended:
            self._live.discard(out.request_id)
            outputs.append(OutputDelta.of(out))

    # ---- the step ------------------------------------------------------------

    def _step(self, batch: StepBatch) -> bool:
        eng = self.engine
        before = eng.num_steps
        t0 = time.perf_counter()
        c0 = time.thread_time()
        try:
            outs = eng.step()
        except Exception as e:
            log.exception("engine step failed; aborting the requests in flight")
            failed = list(self._live)
            self._live.clear()
            # Raises again if the engine cannot even abort: then the loop stops.
            eng.abort_request(failed)
            self.emit(Failed(failed, f"the engine failed while running this request: {e}"))
            return False
        dt = time.perf_counter() - t0
        cpu = time.thread_time() - c0
        vocab = eng.vocab_size
        bad: list[str] = []
        out_list = batch.outputs
        for out in outs:
            ids = out.outputs[0].token_ids
            if ids:
                if not 0 <= min(ids) <= max(ids) < vocab:
                    bad.append(out.request_id)
                    continue
                if math.isnan(batch.token_time) and out.metrics is not None:
                    batch.token_time = out.metrics.last_token_time
            if out.finished:
                self._live.discard(out.request_id)
            out_list.append(OutputDelta.of(out))
        if bad:
            self._fail_bad_tokens(bad)
        if eng.num_steps == before:
            return False
        scheduled = eng.engine_core.last_scheduled
        if scheduled is not None:
            self._marks[scheduled.step] = (self._added, self._aborted)
            self._added, self._aborted = [], []
        es = eng.last_step
        if es is None:
            # Async scheduling put a step in flight; it is logged with its output.
            return True
        so = es.scheduler_output
        added, aborted = self._marks.pop(so.step, ([], []))
        # A step that only told the executor about finished requests explains nothing.
        if self.step_log.capacity and (so.scheduled or added or aborted):
            self.step_log.append(
                StepRecord(
                    step=so.step,
                    time=time.time(),
                    duration_ms=dt * 1000.0,
                    cpu_ms=cpu * 1000.0,
                    num_running=es.num_running,
                    num_waiting=es.num_waiting,
                    kv_usage=es.kv_usage,
                    num_scheduled_tokens=so.total_num_scheduled_tokens,
                    added=added,
                    aborted=aborted,
                    admitted=[r.request_id for r in so.admitted],
                    preempted=[r.request_id for r in so.preempted],
                    finished=[r.request_id for r in es.outputs.finished],
                    trace=so.trace,
                )
            )
        return True

    def _fail_bad_tokens(self, request_ids: list[str]) -> None:
        # A token outside the vocabulary (NaN logits, say) would crash the next
        # step for every request in it; only its own request fails.
        log.error("requests %s sampled a token outside the vocabulary; failing them", request_ids)
        self.engine.abort_request(request_ids)
        self._live.difference_update(request_ids)
        self._aborted.extend(request_ids)
        self.emit(Failed(request_ids, "the model produced a token outside its vocabulary for this request"))

    def snapshot(self) -> EngineSnapshot:
        """The scheduler's figures now."""
        sched = self.engine.scheduler
        stats = sched.prefix_cache_stats
        kv = sched.kv
        conn = self.engine.kv_connector
        last = self.engine.engine_core.last_scheduled
        step_tokens = 0
        # Each scheduled step's tokens are reported once, in the first snapshot after it.
        if last is not None and last is not self._last_reported:
            self._last_reported = last
            step_tokens = last.total_num_scheduled_tokens
        return EngineSnapshot(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_usable_blocks=sched.config.num_gpu_blocks - 1,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_steps=self.engine.num_steps,
            step_tokens=step_tokens,
            waiting_by_reason=waiting_by_reason(self.engine, last.trace if last is not None else None),
            kv_evictions=drain_evictions(self.residency),
            spec_decode=None if self.engine.spec_stats is None else self.engine.spec_stats.as_tuple(),
            external_prefix_cache_queries=getattr(conn, "external_queries", 0),
            external_prefix_cache_hits=getattr(conn, "external_hits", 0),
            encoder_cache=encoder_cache_figures(sched),
        )


def threads_log(engine: LLMEngine) -> list[str]:
    """The startup line naming the model's torch CPU threads (none for executors without them)."""
    threads = getattr(engine.executor, "num_threads", None)
    return [f"The model runs on {threads} torch CPU thread(s) (--num-threads)."] if threads else []
