"""The step scheduler: which requests run how many tokens, and KV for them.

There is no prefill or decode phase. A request holds ``num_tokens`` (prompt
plus generated, plus draft tokens) and ``num_computed_tokens``; each step
hands out tokens so that computed catches up with total, a prefill chunk and
a decode being the same operation with a different count. Running requests
are served first, in running order; waiting ones are admitted only while
budget, sequence slots and KV blocks remain, and never in a step that had to
preempt. In its default configuration every decision equals vLLM V1's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from llmsched.core.config import SchedulerConfig
from llmsched.core.connector import KVConnector, KVConnectorOutput
from llmsched.core.decode_cohort import (
    AsyncDecodeCohort,
    DecodeCohort,
    advance_async_cohort,
    advance_async_decodes,
    async_cohort_of,
    async_cohort_plain_calls,
    async_cohort_schedule,
    async_cohort_update,
)
from llmsched.core.encoder_inputs import EncoderPlan, EncoderScheduler
from llmsched.core.errors import RequestRejected
from llmsched.core.kv.hybrid import HybridKVCacheManager
from llmsched.core.kv.mamba import mamba_aligned_chunk
from llmsched.core.kv.manager import KVCacheManager, PrefixCacheStats, cdiv
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput, StepOutputs
from llmsched.core.policy import Policy, Verdict, WaitingQueue, make_policy
from llmsched.core.remote_kv import RemoteKV
from llmsched.core.request import Request, RequestStatus, check_stop
from llmsched.core.session import Sessions
from llmsched.core.trace import MAX_LISTED_WAITING, PREFIX_CACHE_NOT_READ, Reason, StepTrace

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED
_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_GRAMMAR
_WAITING_FOR_INPUT = RequestStatus.WAITING_FOR_INPUT
_NO_BLOCKS: list = []
_FINISHED = RequestStatus.FINISHED_STOPPED  # this and every later status are terminal


def _holds_blocks(req: Request) -> bool:
    """Whether a waiting request holds KV blocks (it then queues in ``holding``)."""
    return req.num_computed_tokens > 0 or req.status is _REMOTE


# An admission gate returns None to allow admissions this step, or a short
# explanation of why none may happen. The trace files it under the gate's
# ``reason`` attribute when it has one, else under ADMISSION_GATED.
AdmissionGate = Callable[["Scheduler"], "str | None"]


def _schedule_drafts(out: SchedulerOutput, req: Request, num_drafts: int) -> None:
    """List the drafts a scheduled chunk reaches; fresh ones arrive with this step's output."""
    if num_drafts > 0:
        out.spec_decode_tokens[req.request_id] = req.spec_token_ids[:num_drafts]
    req.spec_token_ids = []


def _trace_unreached(trace: StepTrace, reqs: list[Request]) -> None:
    """Trace the running requests the loop never reached: the budget ran out first."""
    for req in reqs:
        trace.add(req.request_id, Reason.BUDGET, detail="reached after the budget ran out")


def _append_tokens(req: Request, toks: list[int], stale: bool) -> bool:
    """Append a step's tokens (a decode and its accepted drafts) up to a stop; whether it stopped."""
    for j, t in enumerate(toks):
        req.token_ids.append(t)
        req.num_tokens += 1
        if (req.num_tokens >= req.stop_length or t in req.stop_ids) and check_stop(req, t):
            # Tokens after the stop are dropped; computed covers all
            # kept tokens but the last, as after any step.
            if not stale:
                req.num_computed_tokens -= len(toks) - j - 1
            return True
    return False


@dataclass(slots=True)
class _Admissions:
    """One step's pass over the waiting queues: what its phases share."""

    out: SchedulerOutput
    trace: StepTrace | None
    budget: int
    threshold: int
    defer: bool
    # A running request continued its prefill this step (no draft padding then).
    prefill_running: bool
    # Adapters in use (None: no max_loras limit).
    loras: set[int] | None
    # Set aside for a reason of their own, put back at the head in their
    # order: those holding KV blocks into the holding queue.
    set_aside: list[Request]
    held_aside: list[Request]
    # Why admissions stopped at a request (None: they did not).
    stop: Reason | None = None
    detail: str = ""
    prefill_admitted: bool = False


class Scheduler:
    """Owns the request queues and the KV cache manager; makes one batch per step."""

    def __init__(
        self, config: SchedulerConfig, policy: Policy | None = None, connector: KVConnector | None = None
    ) -> None:
        self.config = config
        self.policy = policy if policy is not None else make_policy(config.policy, config.policy_config)
        if config.mamba and connector is not None:
            raise ValueError("a KV connector with a hybrid (Mamba) model is not supported")
        self.kv = (HybridKVCacheManager if config.mamba else KVCacheManager)(
            num_blocks=config.num_gpu_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            hash_algo=config.prefix_caching_hash_algo,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.make_queue()
        # Waiting requests that hold KV blocks (sessions between turns, remote
        # loads): admitted before the others.
        self.holding = self.policy.make_queue()
        self.sessions = Sessions(self)
        self.running: list[Request] = []
        self.admission_gate: AdmissionGate | None = None
        # The clock that requests' arrival times read (the simulator sets its own).
        self.clock: Callable[[], float] = time.monotonic
        # False for an executor that never reads block ids (the simulator's):
        # an admission's block ids (SchedulerOutput.admitted_block_ids) are
        # then left empty rather than listed, 64 of them for a 1024-token prompt.
        self.list_block_ids = True
        # Waiting requests the policy declined this step: reported finished by the next update.
        self._declined: list[Request] = []
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._step = 0
        self._trace_enabled = False
        # The encoder budget and cache, made when the first request with
        # encoder inputs arrives (text-only workloads never pay for it).
        self._enc: EncoderScheduler | None = None
        self._read_settings(config)
        self._attach_connector(connector)
        bind = getattr(self.policy, "bind", None)
        if bind is not None:
            bind(self)

    def _read_settings(self, config: SchedulerConfig) -> None:
        """Hot settings as plain attributes (read once per step), and the prefill cadence's state."""
        # Hybrid model with prefix caching: prefill chunks end on block boundaries.
        self._mamba_align = config.mamba and config.enable_prefix_caching
        self._hybrid = config.mamba
        self._max_prefill_chunk = (
            min(config.max_num_batched_tokens, config.long_prefill_token_threshold)
            if config.long_prefill_token_threshold > 0
            else config.max_num_batched_tokens
        )
        self._max_tokens_budget = config.max_num_batched_tokens
        self._max_num_seqs = config.max_num_seqs
        self._max_model_len = config.max_model_len
        self._threshold = config.long_prefill_token_threshold
        self._chunked = config.enable_chunked_prefill
        self._reserve_full = config.scheduler_reserve_full_isl
        self._watermark_blocks = config.watermark_blocks
        self._lookahead = config.num_lookahead_tokens
        self._max_loras = config.max_loras
        self._debug = config.debug
        self._async = config.async_scheduling
        # Async mode: a scheduled decode's next drafts are not known yet, so
        # it carries this many placeholder drafts (vLLM's -1 ids); only their
        # count matters to the scheduler.
        self._draft_placeholders = [-1] * config.num_speculative_tokens
        self._has_drafts = config.num_speculative_tokens > 0
        # Prefill cadence, as vLLM keeps it: executed steps (those scheduling
        # tokens), the last one that carried prefill, whether the last
        # admitting step left the queue undrained, and the requests set
        # aside for reasons of their own (which do not count as undrained).
        self._prefill_interval = config.prefill_schedule_interval
        self._num_executed_steps = 0
        self._last_prefill_step = -self._prefill_interval
        self._prefill_capacity_bound = False
        self._set_aside: set[Request] = set()

    def _attach_connector(self, connector: KVConnector | None) -> None:
        """The KV-connector path (remote KV, delayed frees); without a connector none of it costs anything."""
        self.connector = connector
        self._remote: RemoteKV | None = None
        self._drop_stale_output = False
        if connector is not None:
            cfg = self.config
            self._remote = RemoteKV(
                connector,
                self.kv,
                self.holding,
                cfg.async_scheduling,
                cfg.num_speculative_tokens,
                cfg.num_lookahead_tokens,
            )
            self._drop_stale_output = self._remote.drop_stale_output

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request, or raise RequestRejected leaving all state untouched."""
        rid = request.request_id
        existing = self.requests.get(rid)
        if existing is not None and existing.resumable:
            # The next input of a session (or the end of its input).
            self.sessions.add_input(existing, request)
            return
        if existing is not None or (self._remote is not None and rid in self._remote.sending):
            raise RequestRejected(f"request id {rid!r} is already in use by an unfinished request")
        if (request.status is not _WAITING and request.status is not _WAITING_FOR_GRAMMAR) or (
            request.num_computed_tokens
        ):
            raise RequestRejected(f"request {rid!r} was already scheduled once; add a fresh Request")
        if request.sampling_params.n != 1:
            # One Request is one sequence; n > 1 would silently give one.
            raise RequestRejected(
                f"request {rid!r}: n={request.sampling_params.n}, but a scheduler request is one sequence; "
                "add n requests with n=1 (LLMEngine.add_request forks them)"
            )
        n = request.num_prompt_tokens
        max_len = self._max_model_len
        if n == 0:
            raise RequestRejected(f"request {rid!r}: the prompt is empty")
        if n >= max_len:
            raise RequestRejected(
                f"request {rid!r}: the prompt has {n} tokens but max_model_len is {max_len}; "
                f"a prompt must be shorter than max_model_len to leave room for output"
            )
        stop_length = min(n + request.max_tokens, max_len)
        # The last sampled token is never computed, so KV holds stop_length - 1
        # tokens at most, plus lookahead slots (a prefill reserves them too).
        # Draft slots count only when they and the lookahead reach a block: a
        # step whose drafts do not fit preempts the request, which drops them
        # and resumes without (as vLLM does), but a resume padded to 1 + K
        # tokens after a hit of all but its last token could then never fit.
        cfg = self.config
        drafts = cfg.num_speculative_tokens
        if drafts + cfg.num_lookahead_tokens < cfg.block_size:
            drafts = 0
        max_slots = min(stop_length - 1 + drafts + cfg.num_lookahead_tokens, max_len)
        need = cdiv(max_slots, cfg.block_size)
        usable = cfg.num_gpu_blocks - 1
        if need > usable:
            raise RequestRejected(
                f"request {rid!r}: at its full length ({stop_length} tokens) it needs {need} KV blocks "
                f"of {cfg.block_size} tokens, but the whole cache has {usable}; it could never finish"
            )
        if request.mm_items:
            self.encoder_scheduler.check_request(request)
        request.stop_length = stop_length
        self.requests[rid] = request
        self.waiting.add(request)

    @property
    def encoder_scheduler(self) -> EncoderScheduler:
        """The encoder budget and cache (made on first use)."""
        if self._enc is None:
            cfg = self.config
            self._enc = EncoderScheduler(
                cfg.encoder_budget,
                cfg.encoder_cache_embeddings,
                not cfg.disable_chunked_mm_input,
                cfg.max_num_batched_tokens,
            )
        return self._enc

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """Finish requests from outside (abort); unknown or finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"{status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        found: list[Request] = []
        running: set[Request] = set()
        waiting: set[Request] = set()
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req in running or req in waiting:
                continue
            found.append(req)
            (running if req.status is _RUNNING else waiting).add(req)
        if running:
            self.running = [r for r in self.running if r not in running]
        if waiting:
            self._remove_waiting(waiting)
        remote = self._remote
        for req in found:
            # A load in progress still writes the blocks: they stay until it ends.
            delay_free = remote is not None and req.status is _REMOTE and remote.abort_load(req)
            if req.status is _WAITING_FOR_INPUT:
                self.sessions.forget(req)
            req.status = status
            self._release(req, delay_free)
        return found

    def _remove_waiting(self, reqs: set[Request]) -> None:
        """Take requests out of the waiting queues."""
        if len(self.holding):
            held = {r for r in self.holding if r in reqs}
            if held:
                self.holding.remove(held)
                reqs = reqs - held
        if reqs:
            self.waiting.remove(reqs)
        self._set_aside -= reqs

    def _release(self, req: Request, delay_free: bool = False) -> None:
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        if self._enc is not None and req.mm_items:
            self._enc.release(req)
        if self._remote is not None:
            self._remote.finished_with_delay(req, delay_free)
        else:
            self.kv.free(req)

    def has_requests(self) -> bool:
        """True while anything is waiting, running, finished but unreported, or holding blocks to send."""
        if self.running or self._finished_ids or self.num_waiting > self.sessions.num_waiting_for_input:
            return True
        remote = self._remote
        return remote is not None and bool(remote.sending)

    def has_unfinished_requests(self) -> bool:
        """True while anything is waiting or running (sessions waiting for input do not count)."""
        return bool(self.running) or self.num_waiting > self.sessions.num_waiting_for_input

    @property
    def num_waiting(self) -> int:
        """Waiting requests, those holding blocks (remote KV, sessions between turns) included."""
        return len(self.waiting) + len(self.holding)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self.running), self.num_waiting

    @property
    def kv_usage(self) -> float:
        """Fraction of usable KV blocks held by requests."""
        return self.kv.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache lookups at admission."""
        return self.kv.stats

    def reset_prefix_cache(self) -> bool:
        """Forget cached KV content; refused (False) while any request holds blocks."""
        return self.kv.reset_prefix_cache()

    def enable_trace(self, enabled: bool = True) -> None:
        """Attach a StepTrace to every SchedulerOutput from now on (or stop)."""
        self._trace_enabled = enabled

    # ---- one step ------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """Decide this step's batch, allocate its KV slots and advance computed counts.

        ``throttle_prefills`` (set by a data-parallel engine on the steps its
        shared cadence skips) defers all prefill work this step, as
        ``prefill_schedule_interval`` does locally.
        """
        out = SchedulerOutput(self._step)
        self._step += 1
        trace = StepTrace(out.step) if self._trace_enabled else None
        out.trace = trace
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        if self._enc is not None:
            self._enc.begin_step()
        if self._hybrid:
            self.kv.new_step()
        num_waiting = len(self.waiting) + len(self.holding)
        # The threshold exists so a long prefill cannot starve others; a lone
        # request has nobody to starve, so it gets the whole budget.
        threshold = self._threshold if len(self.running) + num_waiting > 1 else 0
        defer = self._defers_prefills(throttle_prefills)
        budget, prefill_scheduled = self._schedule_running(out, trace, threshold, defer)
        if out.preempted:
            # As in vLLM, a step that had to preempt admits nobody.
            prefill_admitted = False
            if trace is not None:
                self._trace_waiting(trace, None, Reason.PREEMPTION_STEP, "", whole_queue=True)
        else:
            budget, prefill_admitted = self._schedule_waiting(
                out, trace, budget, threshold, defer, num_waiting, prefill_scheduled
            )
        self._close_step(out, budget, prefill_scheduled or prefill_admitted)
        return out

    # ---- plain decode steps -----------------------------------------------------

    @property
    def next_step(self) -> int:
        """The number the next scheduled step will carry."""
        return self._step

    def plain_decode_steps(
        self, token_id: int, limit: int, finished_ids_unread: bool = False, through_finish: bool = False
    ) -> int:
        """How many of the next steps (at most ``limit``) are plain decodes, if every sample is ``token_id``.

        A plain decode step schedules one token for every running request
        and admits, preempts, finishes and defers nothing: nothing waits,
        every running request has sampled all its known tokens, the budget
        covers them all, none reaches its stop length or samples a stop
        token, and the free blocks cover every table's growth. Such steps
        are exactly what ``advance_decode_steps`` applies. 0 whenever the
        next step might be anything else (sync mode without a connector,
        drafts, lookahead or a trace only). Requests finished since the
        last step are reported in the next batch's ``finished_req_ids``, so
        they make that step not plain, unless ``finished_ids_unread`` says
        the executor never reads them (the simulator's): then the first
        plain step drops them as schedule() would hand them over. With
        ``through_finish`` the steps may end with the one whose update
        finishes the requests it brings to their stop length (not a session's
        turn, without encoder inputs): ``advance_decode_steps`` finishes them.
        """
        running = self.running
        if (
            not self._steps_may_be_plain()
            or (self._finished_ids and not finished_ids_unread)
            or len(self.waiting)
            or len(self.holding)
            or not running
            or len(running) > self._max_tokens_budget
        ):
            return 0
        k = limit
        for r in running:
            if r.is_prefill_chunk or r.num_tokens != r.num_computed_tokens + 1 or token_id in r.stop_ids:
                return 0
            # The step that brings it to stop_length finishes it (which also
            # keeps positions below max_model_len).
            left = r.stop_length - r.num_tokens - 1
            if left < k:
                k = left
        # Step k + 1 finishes those with k plain steps left, as update_from_output would.
        if (
            through_finish
            and 0 <= k < limit
            and self._enc is None
            and not self._declined
            and not any(r.resumable for r in running if r.stop_length - r.num_tokens - 1 == k)
        ):
            k += 1
        if k <= 0:
            return 0
        kv = self.kv
        need = 0
        for r in running:
            need += kv.decode_blocks_needed(r, k)
        return k if need <= kv.num_free_blocks else 0

    def advance_decode_steps(self, num_steps: int, token_id: int) -> list[Request]:
        """Apply ``num_steps`` plain decode steps (see ``plain_decode_steps``) with ``token_id`` sampled.

        Each step leaves the state ``schedule()`` then ``update_from_output()``
        would: the step counters advance, every running request computes one
        token (its KV slots allocated in running order, as schedule() does,
        wherever the allocation adds or registers a block) and appends the
        sampled token. Returns the requests the last step finished, in
        running order (only a run ``through_finish`` ends finishing any).
        """
        cohort = DecodeCohort(self.kv, token_id)
        for r in self.running:
            cohort.join(r)
        finished = self.advance_cohort(cohort, num_steps)
        cohort.flush()
        return finished

    def async_plain_decode_steps(self, token_id: int, limit: int, through_finish: bool = False) -> int:
        """Async mode: how many of the next engine calls (at most ``limit``) are plain decodes.

        A plain call schedules one token for every running request (each
        with one placeholder, its step in flight) and applies the step in
        flight, which must have decoded every running request one token (the
        engine checks that): nothing waits or is declined, no request reaches
        its stop length or samples ``token_id`` as a stop token in the
        calls, the free blocks cover every table's growth, and nothing
        (connector, drafts, trace, hybrid groups, encoder, cadence) does more.
        With ``through_finish`` the calls may end with the one that finishes
        the requests it brings to their stop length (not sessions' turns, and
        not every running request). ``advance_async_decode_steps`` applies
        such calls.
        """
        running = self.running
        if (
            not self._async
            or self._step_does_more()
            or self._debug
            or self._enc is not None
            or self._prefill_interval > 1
            or self._declined
            or len(self.waiting)
            or len(self.holding)
            or not running
            or len(running) > self._max_tokens_budget
        ):
            return 0
        k = limit
        for r in running:
            if (
                r.is_prefill_chunk
                or r.num_tokens != r.num_computed_tokens
                or r.num_output_placeholders != 1
                or r.num_in_flight_tokens != 1
                or r.num_stale_output_tokens
                or r.spec_token_ids
                or token_id in r.stop_ids
                # schedule()'s in-flight skip reads max_tokens: it must be what stops it.
                or r.stop_length != r.num_prompt_tokens + r.max_tokens
            ):
                return 0
            # Call k applies the step giving token num_tokens + k: stop before it reaches stop_length.
            left = r.stop_length - r.num_tokens - 1
            if left < k:
                k = left
        if (
            through_finish
            and 0 <= k < limit
            and not any(r.resumable for r in running if r.stop_length - r.num_tokens - 1 == k)
            and any(r.stop_length - r.num_tokens - 1 > k for r in running)
        ):
            k += 1
        if k <= 0:
            return 0
        kv = self.kv
        need = 0
        for r in running:
            need += kv.decode_blocks_needed(r, k)
        return k if need <= kv.num_free_blocks else 0

    def advance_async_decode_steps(
        self, num_steps: int, token_id: int, through_finish: bool = False
    ) -> list[Request]:
        """Apply ``num_steps`` calls proven plain by ``async_plain_decode_steps``, ``token_id`` sampled.

        Leaves the state those calls' schedule() and update_from_output()
        would: the last call's step in flight, every request with one
        placeholder. Returns the requests the last call finished, in running
        order (only a run ``through_finish`` finishes any).
        """
        finished = advance_async_decodes(self.kv, self.running, num_steps, token_id, through_finish)
        self._finished_ids = []
        self._step += num_steps
        self._num_executed_steps += num_steps
        # What a schedule() with an empty queue sets.
        self._prefill_capacity_bound = False
        if finished:
            # update_from_output's resolution, registration, stop check and removal, in its order.
            for r in finished:
                r.num_output_placeholders = 0
                r.num_in_flight_tokens = 0
                check_stop(r, token_id)
                self.kv.cache_blocks(r, r.num_computed_tokens)
            self._remove_stopped(finished, set())
        return finished

    # ---- decode cohorts: plain decodes kept lazily across admitting steps --------

    def start_async_cohort(self, token_id: int, in_flight: SchedulerOutput) -> AsyncDecodeCohort | None:
        """Async: an AsyncDecodeCohort of every running request (``decode_cohort.async_cohort_of``)."""
        return async_cohort_of(self, token_id, in_flight)

    def async_cohort_schedule(
        self, cohort: AsyncDecodeCohort
    ) -> tuple[SchedulerOutput, list[Request], int, int] | None:
        """schedule() with ``cohort``'s decodes kept lazy (see ``decode_cohort.async_cohort_schedule``)."""
        return async_cohort_schedule(self, cohort)

    def async_cohort_plain_calls(self, cohort: AsyncDecodeCohort, limit: int) -> int:
        """How many coming calls are plain decodes of ``cohort`` (``async_cohort_plain_calls``)."""
        return async_cohort_plain_calls(self, cohort, limit)

    def advance_async_cohort(
        self, cohort: AsyncDecodeCohort, num_calls: int, finishing: list[Request]
    ) -> SchedulerOutput:
        """Apply plain calls of ``cohort``; the last one's step (``decode_cohort.advance_async_cohort``)."""
        return advance_async_cohort(self, cohort, num_calls, finishing)

    def async_cohort_update(
        self,
        cohort: AsyncDecodeCohort,
        out: SchedulerOutput,
        result: ModelRunnerOutput,
        finishing: list[Request],
        decodes: int,
    ) -> tuple[list[Request], int, list[Request]]:
        """update_from_output() of ``out`` in a cohort call (see ``decode_cohort.async_cohort_update``)."""
        return async_cohort_update(self, cohort, out, result, finishing, decodes)

    def _steps_may_be_plain(self) -> bool:
        """False where a step always does more than schedule what it is asked (see ``plain_decode_steps``)."""
        return not (self._async or self._step_does_more())

    def _step_does_more(self) -> bool:
        """Whether a step does more than schedule decodes (connector, drafts, lookahead, trace, hybrid)."""
        return (
            self.connector is not None
            or self._has_drafts
            or self._lookahead
            or self._trace_enabled
            or self._hybrid
        )

    def start_cohort(self, token_id: int) -> DecodeCohort | None:
        """A DecodeCohort of every running request, if ``cohort_step`` can serve the coming steps.

        Besides what plain steps need, admissions must be the plain FCFS
        kind (no policy that preempts, declines or reorders, no gate, no
        cadence, no LoRA slots, no encoder inputs), so that a step's decodes
        stay one token each whatever is admitted behind them. None when any
        running request is not a plain decode (or could stop on ``token_id``,
        or is a session).
        """
        if (
            not self._steps_may_be_plain()
            or self.policy.decides_admission
            or self.admission_gate is not None
            or self._prefill_interval > 1
            or self._max_loras is not None
            or self._enc is not None
            or self._mamba_align
            or self._debug
            or self._declined
            or len(self.holding)
            or len(self.running) > self._max_tokens_budget
        ):
            return None
        for r in self.running:
            if (
                r.is_prefill_chunk
                or r.num_tokens != r.num_computed_tokens + 1
                or token_id in r.stop_ids
                or r.resumable
            ):
                return None
        cohort = DecodeCohort(self.kv, token_id)
        for r in self.running:
            cohort.join(r)
        return cohort

    def cohort_plain_steps(self, cohort: DecodeCohort, limit: int) -> int:
        """How many of the next steps (at most ``limit``) are plain decodes of ``cohort``.

        ``plain_decode_steps`` for a cohort, without a pass over it: every
        running request must be a member and nothing may wait. The steps run
        through the one that finishes the next member. A member's table
        covers its computed tokens, so k more tokens need at most
        k // block_size + 1 new blocks: while the free blocks cover that for
        every member, no allocation can fail and nobody is preempted.
        """
        d = len(self.running)
        if not d or d != len(cohort) or len(self.waiting) or len(self.holding):
            return 0
        kv = self.kv
        k = min(
            limit, int(cohort.next_finish()) - cohort.steps + 1, (kv.num_free_blocks // d) * kv.block_size - 1
        )
        return k if k > 0 else 0

    def advance_cohort(self, cohort: DecodeCohort, num_steps: int) -> list[Request]:
        """Apply ``num_steps`` plain decode steps (see ``cohort_plain_steps``) to ``cohort``.

        Returns the requests the last step finished, freed.
        """
        finished = cohort.advance(num_steps)
        # The first step's finished_req_ids (see plain_decode_steps).
        self._finished_ids = []
        self._step += num_steps
        self._num_executed_steps += num_steps
        # What an admitting step with an empty queue sets.
        self._prefill_capacity_bound = False
        if finished:
            # update_from_output's stop check and removal, in its order.
            for r in finished:
                check_stop(r, cohort.token_id)
            self._remove_stopped(finished, set())
        return finished

    def cohort_schedule(self, cohort: DecodeCohort) -> tuple[SchedulerOutput, list[Request]] | None:
        """schedule() for a step in which ``cohort`` (all that runs) decodes and the queue is admitted.

        The decodes run first, as schedule()'s running phase would give them
        one token each; admissions are schedule()'s own, with the budget the
        decodes leave. The output lists the admitted requests only (the
        executor adds the members). Returns it and the members this step
        finishes (their token appended), for ``cohort_update``; None when the
        step may be anything else (the caller then flushes the cohort).
        """
        running = self.running
        d = len(running)
        if (
            d != len(cohort)
            or len(self.holding)
            or d > self._max_tokens_budget
            # One new block per member at most (see cohort_plain_steps).
            or d > self.kv.num_free_blocks
        ):
            return None
        out = SchedulerOutput(self._step)
        self._step += 1
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        finishing = cohort.advance(1)
        num_waiting = len(self.waiting)
        threshold = self._threshold if d + num_waiting > 1 else 0
        budget = self._max_tokens_budget - d
        if num_waiting:
            budget = self._admit(out, budget, threshold, False, None)[0]
        self._prefill_capacity_bound = self.num_waiting > len(self._set_aside)
        out.total_num_scheduled_tokens = total = self._max_tokens_budget - budget
        if total:
            self._num_executed_steps += 1
        return out, finishing

    def cohort_update(
        self, cohort: DecodeCohort, out: SchedulerOutput, finishing: list[Request]
    ) -> tuple[list[Request], list[Request]]:
        """update_from_output() for a ``cohort_schedule`` step, every sampler given the cohort's token.

        Admitted requests that sampled a token and decode plainly from now
        on join the cohort. Returns the admitted requests that sampled, and
        every request the step finished, in update order (members first).
        """
        token = cohort.token_id
        finished = finishing
        for r in finished:
            check_stop(r, token)
        samplers = []
        for req in out.scheduled:
            if req.num_computed_tokens < req.num_tokens:
                continue  # a partial prefill chunk
            samplers.append(req)
            req.token_ids.append(token)
            req.num_tokens += 1
            if (req.num_tokens >= req.stop_length or token in req.stop_ids) and check_stop(req, token):
                finished.append(req)
            elif not req.resumable and token not in req.stop_ids:
                cohort.join(req)
        if finished:
            self._remove_stopped(finished, set())
        return samplers, finished

    def _mark_in_flight(self, out: SchedulerOutput) -> None:
        """Async mode: count the batch in flight and give each sampling request its placeholders."""
        spec = out.spec_decode_tokens
        drafts = self._draft_placeholders
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            req.num_in_flight_tokens += n
            if req.is_prefill_chunk:
                continue
            req.num_output_placeholders += 1 + len(spec.get(req.request_id, ())) if spec else 1
            if drafts:
                req.spec_token_ids = drafts

    # ---- the phases of a step ------------------------------------------------

    def _defers_prefills(self, throttle: bool) -> bool:
        """Whether this step holds prefill work back to the cadence."""
        if not (throttle or self._prefill_interval > 1) or self._prefill_capacity_bound:
            return False
        # Defer only while decodes exist to fill the step; the interval
        # counts executed steps since the last one that carried prefill.
        return (
            throttle or self._num_executed_steps + 1 - self._last_prefill_step < self._prefill_interval
        ) and any(not r.is_prefill_chunk for r in self.running)

    def _schedule_running(
        self, out: SchedulerOutput, trace: StepTrace | None, threshold: int, defer: bool
    ) -> tuple[int, bool]:
        """Serve running requests in running order; returns (budget left, whether a prefill continued)."""
        sched, ntoks, running = out.scheduled, out.num_scheduled_tokens, self.running
        kv, enc, lookahead = self.kv, self._enc, self._lookahead
        max_len, budget = self._max_model_len, self._max_tokens_budget
        align, mm = self._mamba_align, enc is not None
        prefill_scheduled = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            # Async mode: tokens the steps in flight will sample, already in computed.
            placeholders = req.num_output_placeholders
            n = req.num_tokens + placeholders - computed
            if req.spec_token_ids:
                n += len(req.spec_token_ids)
            wanted = n
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n > max_len - 1 - computed:  # positions stay below it (matters with drafts)
                n = max_len - 1 - computed
            plan, held = None, ""
            done = placeholders and computed + 2 - placeholders >= req.num_prompt_tokens + req.max_tokens
            if done or n <= 0 or (defer and req.is_prefill_chunk) or align or (mm and req.mm_items):
                n, plan, held = self._fit_running(req, computed, n, bool(done), defer, budget, trace)
                if n <= 0:
                    i += 1
                    continue
            new_blocks = kv.allocate_slots(req, n, lookahead)
            if new_blocks is None:
                new_blocks, i, freed = self._preempt_for_running(out, req, n, i, trace)
                budget += freed
                if new_blocks is None:
                    if req.status is _PREEMPTED:
                        # It preempted itself: running[i] is the next request, which may fit now.
                        continue
                    break
            if req.is_prefill_chunk:
                prefill_scheduled = True
            req.num_computed_tokens = computed + n
            req.is_prefill_chunk = computed + n < req.num_tokens + placeholders
            if plan is not None:
                enc.commit(req, plan)
            sched.append(req)
            ntoks.append(n)
            if new_blocks:
                out.new_block_ids[req.request_id] = [b.block_id for b in new_blocks]
            if req.spec_token_ids:
                _schedule_drafts(out, req, computed + n - req.num_tokens - placeholders)
            if trace is not None:
                self._trace_scheduled(trace, req, computed, n, wanted, budget, threshold, held=held)
            budget -= n
            i += 1
        if trace is not None:
            _trace_unreached(trace, running[i:])
        return budget, prefill_scheduled

    def _fit_running(
        self,
        req: Request,
        computed: int,
        n: int,
        done: bool,
        defer: bool,
        budget: int,
        trace: StepTrace | None,
    ) -> tuple[int, EncoderPlan | None, str]:
        """A running request's chunk in the rarer cases: (n, encoder plan, what held it short).

        ``n`` = 0: passed over this step (traced here): ``done`` (max_tokens
        already in flight), a deferred prefill, a Mamba boundary not
        reached, an item the encoder cannot take, or nothing to compute.
        """
        why: tuple[Reason, str] | None = None
        plan: EncoderPlan | None = None
        held = ""
        if done:
            # The steps in flight reach max_tokens even if every draft among
            # the placeholders is rejected: another step would be wasted.
            why = Reason.MAX_TOKENS_IN_FLIGHT, f"{req.num_output_placeholders} in flight"
        elif defer and req.is_prefill_chunk:
            why = Reason.PREFILL_DEFERRED, "chunk held to a cadence step"
        else:
            if self._mamba_align and n > 0:
                n = self._aligned_chunk(req, computed, n)
                if n == 0:
                    why = Reason.MAMBA_ALIGNMENT, f"{budget} tokens left"
            enc = self._enc
            if why is None and enc is not None and req.mm_items:
                # Items the chunk overlaps must be cached or fit the encoder budget and cache.
                n, plan, held = enc.try_schedule(req, computed, n)
            if why is None and n <= 0:
                why = (Reason.ENCODER_HELD if held else Reason.NOTHING_TO_COMPUTE), held
        if why is None:
            return n, plan, held
        if trace is not None:
            trace.add(req.request_id, why[0], detail=why[1])
        return 0, None, ""

    def _preempt_for_running(
        self, out: SchedulerOutput, req: Request, n: int, i: int, trace: StepTrace | None
    ) -> tuple[list | None, int, int]:
        """Preempt victims until running ``req`` (at ``i``) gets blocks for ``n`` tokens or goes itself.

        Returns the blocks (None: not allocated), ``req``'s index once the
        victims left, and the tokens victims scheduled earlier gave back.
        """
        running = self.running
        remote = self._remote
        new_blocks = None
        freed = 0
        while True:
            victim = self.policy.select_victim(running)
            if remote is not None and not remote.can_preempt(victim):
                # Freeing the victim would not give blocks back now.
                break
            vi = running.index(victim)
            del running[vi]
            if vi < i:
                i -= 1
                freed += self._unschedule(out, victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if trace is not None:
                trace.add(
                    victim.request_id,
                    Reason.PREEMPTED,
                    detail=("by itself" if victim is req else f"by {req.request_id}")
                    + f": KV blocks short for {n} more tokens",
                )
            if victim is req:
                break
            new_blocks = self.kv.allocate_slots(req, n, self._lookahead)
            if new_blocks is not None:
                break
        return new_blocks, i, freed

    def _schedule_waiting(
        self,
        out: SchedulerOutput,
        trace: StepTrace | None,
        budget: int,
        threshold: int,
        defer: bool,
        num_waiting: int,
        prefill_running: bool,
    ) -> tuple[int, bool]:
        """Admit waiting requests unless the gate is closed; returns (budget left, whether prefill came)."""
        gate = self.admission_gate
        why_gated = gate(self) if gate is not None and num_waiting else None
        if why_gated is not None:
            if trace is not None:
                reason = getattr(gate, "reason", Reason.ADMISSION_GATED)
                self._trace_waiting(trace, None, reason, why_gated, whole_queue=True)
            return budget, False
        prefill_admitted = False
        if num_waiting:
            budget, prefill_admitted = self._admit(out, budget, threshold, defer, trace, prefill_running)
        if not defer:
            # An admitting step that left requests queued for lack of
            # room stops the cadence from throttling: holding back a
            # backed-up queue would only grow it.
            self._prefill_capacity_bound = self.num_waiting > len(self._set_aside)
        return budget, prefill_admitted

    def _close_step(self, out: SchedulerOutput, budget: int, carried_prefill: bool) -> None:
        """The step's closing bookkeeping: totals, Mamba and encoder inputs, connector, cadence."""
        out.total_num_scheduled_tokens = total = self._max_tokens_budget - budget
        if self._hybrid:
            ids = self.kv.mamba.state_ids
            out.mamba_state_ids = {r.request_id: ids(r.request_id, s, s + n) for r, s, n in out.chunks()}
        enc = self._enc
        if enc is not None:
            out.encoder_inputs = enc.scheduled
            out.freed_encoder_ids = enc.take_evicted()
        remote = self._remote
        if remote is not None:
            if out.trace is not None:
                remote.trace_events(out.trace)
            remote.after_schedule(out)
        if self._async:
            self._mark_in_flight(out)
        if total:
            self._num_executed_steps += 1
        if carried_prefill and self._prefill_interval > 1:
            self._last_prefill_step = self._num_executed_steps
        if self._debug:
            self._check_invariants(out)

    def _admit(
        self,
        out: SchedulerOutput,
        budget: int,
        threshold: int,
        defer: bool,
        trace: StepTrace | None,
        prefill_running: bool = False,
    ) -> tuple[int, bool]:
        """Admit waiting requests in policy order; returns the budget left and
        whether an admission carried prefill work. ``prefill_running``: a
        running request continued its prefill this step."""
        waiting = self.waiting
        holding = self.holding
        running = self.running
        sessions = self.sessions
        max_num_seqs = self._max_num_seqs
        decides = self.policy.decides_admission
        loras = {r.lora_id for r in running if r.lora_id} if self._max_loras is not None else None
        a = _Admissions(out, trace, budget, threshold, defer, prefill_running, loras, [], [])
        while a.budget > 0:
            # Requests holding blocks (sessions, connector loads) go first.
            queue = holding if len(holding) else waiting
            if not len(queue):
                break
            req = queue.peek()
            # Sessions waiting for input keep their sequence slot.
            if len(running) + sessions.num_waiting_for_input >= max_num_seqs:
                freed = self._preempt_for(out, req, trace) if decides else None
                if freed is None:
                    a.stop, a.detail = Reason.MAX_NUM_SEQS, f"{len(running)} running"
                    break
                a.budget += freed
            if not self._admit_head(a, queue, req):
                break
        if a.set_aside:
            waiting.requeue(a.set_aside)
        if a.held_aside:
            holding.requeue(a.held_aside)
        if trace is not None and len(waiting):
            stop, detail = a.stop, a.detail
            if stop is None:
                stop, detail = Reason.BUDGET, f"all {self._max_tokens_budget} tokens of the step are used"
            self._trace_waiting(trace, a.set_aside, stop, detail)
        return a.budget, a.prefill_admitted

    def _admit_head(self, a: _Admissions, queue: WaitingQueue, req: Request) -> bool:
        """Admit or set aside ``req``, the head of ``queue``; False when admissions stop at it."""
        remote = self._remote
        why = (
            self._why_set_aside(req, a.loras, self._max_loras)
            if remote is not None
            or req.num_stale_output_tokens
            or a.loras is not None
            or req.status is _WAITING_FOR_GRAMMAR
            or req.status is _WAITING_FOR_INPUT
            else None
        )
        if why is None and self.policy.decides_admission:
            refusal = self._policy_refusal(a.out, req, None, queue, a.set_aside, a.held_aside, a.trace)
            if refusal is not None:
                if refusal[0] is Verdict.STOP:
                    a.stop, a.detail = refusal[1], refusal[2]
                    return False
                return True
        hit_blocks, hit, ext, load_async = _NO_BLOCKS, -1, 0, False
        if why is None:
            hit_blocks, hit = self._lookup_prefix(req)
            if remote is not None and hit >= 0:
                # The connector: tokens it can load beyond the local hit.
                ext, load_async = remote.lookup(req, hit)
                if ext is None:
                    why = Reason.REMOTE_KV, 0, "the connector cannot tell yet"
        if why is not None:
            self._put_aside(a, queue, req, why)
            return True
        computed = hit + ext if hit >= 0 else req.num_computed_tokens
        chunk = (0, None, "") if load_async else self._admission_size(a, queue, req, computed)
        if chunk is None:
            return a.stop is None
        n, plan, held = chunk
        blocks = self._allocate_admission(a, queue, req, n, hit_blocks, hit, ext, load_async)
        if blocks is None:
            return a.stop is None
        if load_async:
            self._start_load(a, queue, req, computed, ext)
        else:
            self._start_running(a, queue, req, blocks, computed, n, hit, plan, held)
        return True

    def _lookup_prefix(self, req: Request) -> tuple[list, int]:
        """The prefix-cache hit for the head: (blocks, tokens); tokens -1 for no lookup."""
        if req.num_computed_tokens == 0:
            return self.kv.get_computed_blocks(req)
        # Its blocks hold KV loaded by the connector; nothing to look up.
        return _NO_BLOCKS, -1

    def _put_aside(
        self, a: _Admissions, queue: WaitingQueue, req: Request, why: tuple[Reason, int, str]
    ) -> None:
        """Set the head aside for a reason of its own: those behind it may still go."""
        queue.pop()
        self._set_aside.add(req)
        (a.held_aside if _holds_blocks(req) else a.set_aside).append(req)
        if a.trace is not None:
            a.trace.add(req.request_id, *why)

    def _admission_size(
        self, a: _Admissions, queue: WaitingQueue, req: Request, computed: int
    ) -> tuple[int, EncoderPlan | None, str] | None:
        """Tokens to admit the head with: (n, encoder plan, what held it short).

        None when it is not admitted now; ``a.stop`` then says whether
        admissions stop at it.
        """
        out = a.out
        # With drafts, vLLM pads a one-token admission to a full draft
        # step (keeps the batch uniform) unless prefill runs in it.
        # After a sync KV load too (computed includes the loaded part).
        pad = (
            self._has_drafts
            and self.config.pad_draft_admissions
            and not a.prefill_running
            and (computed > 0 or len(out.scheduled) > len(out.admitted))
        )
        n, stop, detail = self._admission_chunk(req, computed, a.budget, a.threshold, a.defer, pad)
        if stop is not None:
            self._blocked(a, queue, req, stop, detail)
            return None
        if self._mamba_align:
            n = self._aligned_chunk(req, computed, n)
            if n == 0:
                a.stop, a.detail = Reason.MAMBA_ALIGNMENT, f"{a.budget} tokens left"
                return None
        enc = self._enc
        if enc is not None and req.mm_items:
            n, plan, held = enc.try_schedule(req, computed, n)
            if n == 0:
                # An item it reaches cannot be encoded this step:
                # set aside, so those behind it may still go (as vLLM).
                self._put_aside(a, queue, req, (Reason.ENCODER_HELD, 0, held))
                return None
            return n, plan, held
        return n, None, ""

    def _allocate_admission(
        self,
        a: _Admissions,
        queue: WaitingQueue,
        req: Request,
        n: int,
        hit_blocks: list,
        hit: int,
        ext: int,
        load_async: bool,
    ) -> list | None:
        """KV blocks to admit the head, preempting for them where the policy decides.

        None when they cannot be had; ``a.stop`` then says whether
        admissions stop at it.
        """
        kv = self.kv
        remote = self._remote
        decides = self.policy.decides_admission
        lookahead = self._lookahead
        while True:
            reserved = self._watermark_blocks if self.running else 0
            if remote is None:
                if hit < 0:
                    # A session resuming: its blocks hold the KV computed so far.
                    blocks = kv.allocate_held(req, n, lookahead, self._reserve_full, reserved)
                else:
                    blocks = kv.allocate_new(req, n, hit_blocks, lookahead, self._reserve_full, reserved)
            else:
                blocks = remote.allocate(
                    req, n, hit_blocks, ext, load_async, lookahead, self._reserve_full, reserved
                )
            if blocks is not None or not decides:
                break
            freed = self._preempt_for(a.out, req, a.trace)
            if freed is None:
                break
            a.budget += freed
        if blocks is None:
            if self._enc is not None and req.mm_items:
                self._enc.release(req)
            stop, detail = self._why_no_blocks(req, hit_blocks, ext + n, reserved)
            self._blocked(a, queue, req, stop, detail)
            return None
        if remote is not None:
            remote.allocated(req, ext)
        if hit >= 0:
            kv.record_admission(req, hit)
        return blocks

    def _start_load(self, a: _Admissions, queue: WaitingQueue, req: Request, computed: int, ext: int) -> None:
        """Start the connector's asynchronous load for the head; it waits in the holding queue meanwhile."""
        self._remote.start_load(req, computed)
        queue.pop()
        self._set_aside.add(req)
        a.held_aside.append(req)
        if a.trace is not None:
            a.trace.add(req.request_id, Reason.REMOTE_KV, detail=f"load of {ext} tokens started")

    def _policy_refusal(
        self,
        out: SchedulerOutput,
        req: Request,
        blocked: tuple[Reason, str] | None,
        queue: WaitingQueue,
        set_aside: list[Request],
        held_aside: list[Request],
        trace: StepTrace | None,
    ) -> tuple[Verdict, Reason, str] | None:
        """Ask the policy about the head ``req``; apply a skip or a decline and return the refusal."""
        if out.preempted and req in out.preempted:
            # Preempted for a waiting request this step: it may not come back in the same step.
            refusal = (Verdict.SKIP, Reason.PREEMPTED_FOR_WAITING, "preempted this step")
        else:
            refusal = self.policy.admit(req, blocked)
            if refusal is None:
                return None
        verdict, reason, detail = refusal
        if verdict is not Verdict.STOP:
            queue.pop()
            if verdict is Verdict.SKIP:
                remote = self._remote
                (held_aside if remote is not None and remote.holds_blocks(req) else set_aside).append(req)
            else:
                self._decline(req)
        if trace is not None and verdict is not Verdict.STOP:
            # A stop is traced with the rest of the queue, when admissions end.
            trace.add(req.request_id, reason, detail=detail)
        return refusal

    def _blocked(self, a: _Admissions, queue: WaitingQueue, req: Request, stop: Reason, detail: str) -> None:
        """The head did not fit: admissions stop at it (``a.stop``) unless the policy skips or declines it."""
        if self.policy.decides_admission:
            refusal = self._policy_refusal(
                a.out, req, (stop, detail), queue, a.set_aside, a.held_aside, a.trace
            )
            if refusal is not None:
                if refusal[0] is Verdict.STOP:
                    stop, detail = refusal[1], refusal[2]
                else:
                    a.stop, a.detail = None, ""
                    return
        a.stop, a.detail = stop, detail

    def _preempt_for(self, out: SchedulerOutput, req: Request, trace: StepTrace | None) -> int | None:
        """Preempt the running request the policy picks to make room for waiting ``req``.

        Returns the tokens the victim had been given this step, or None when
        the policy picks none. Requests admitted this step are never victims.
        """
        admitted = out.admitted
        candidates = [r for r in self.running if r not in admitted] if admitted else list(self.running)
        victim = self.policy.select_victim(candidates, req) if candidates else None
        if victim is None or (self._remote is not None and not self._remote.can_preempt(victim)):
            return None
        self.running.remove(victim)
        freed = self._unschedule(out, victim)
        self._preempt(victim)
        out.preempted.append(victim)
        if trace is not None:
            trace.add(victim.request_id, Reason.PREEMPTED_FOR_WAITING, detail=f"for {req.request_id}")
        return freed

    def _decline(self, req: Request) -> None:
        """Finish a waiting request (already out of its queue) that the policy will not serve."""
        self._set_aside.discard(req)
        req.status = RequestStatus.FINISHED_ABORTED
        req.stop_reason = "declined"
        self._release(req)
        self._declined.append(req)

    def _aligned_chunk(self, req: Request, start: int, n: int) -> int:
        """``n`` cut to end on a block boundary where a Mamba state is cached (0: not this step)."""
        return mamba_aligned_chunk(
            req.num_prompt_tokens,
            req.num_tokens,
            start,
            n,
            self.config.block_size,
            self._max_prefill_chunk,
            self.kv.junction(req),  # type: ignore[attr-defined]
        )

    def requeue_holding(self, req: Request) -> None:
        """A request holding blocks had its priority key changed where it is queued."""
        rekey = getattr(self.holding, "rekey", None)
        if rekey is not None:
            rekey(req)

    def _admission_chunk(
        self, req: Request, computed: int, budget: int, threshold: int, defer: bool, pad: bool = False
    ) -> tuple[int, Reason | None, str]:
        """Tokens to admit ``req`` with beyond ``computed``, or why admissions stop at it.

        ``pad``: a one-token admission is padded with placeholder drafts to
        a full draft step, where max_model_len leaves room for it.
        """
        if defer and computed < req.num_tokens - 1:
            return 0, Reason.PREFILL_DEFERRED, "prompt held to a cadence step"
        n = req.num_tokens - computed
        if pad and n == 1:
            padded = 1 + self.config.num_speculative_tokens
            # Not where the padded step could never be scheduled (vLLM would
            # wait forever) or the threshold would cut it (vLLM fails).
            if (
                computed + padded + 1 <= self._max_model_len
                and padded <= self._max_tokens_budget
                and not 0 < threshold < padded
            ):
                if padded > budget:
                    # vLLM would rather not admit than admit unpadded.
                    return 0, Reason.BUDGET, f"a padded draft step needs {padded} tokens, {budget} left"
                n = padded
        if 0 < threshold < n:
            n = threshold
        if not self._chunked and n > budget:
            return 0, Reason.NO_CHUNKING, f"needs {n} tokens, {budget} left"
        return min(n, budget), None, ""

    def _why_set_aside(
        self, req: Request, loras: set[int] | None, max_loras: int | None
    ) -> tuple[Reason, int, str] | None:
        """Why the head of the queue must wait while those behind it may go, or None."""
        if req.status is _WAITING_FOR_INPUT:
            return Reason.WAITING_FOR_INPUT, 0, "its turn ended; it holds its KV until the next input"
        if req.status is _REMOTE and not self._remote.ready(req):
            return Reason.REMOTE_KV, 0, "load in progress"
        if req.status is _WAITING_FOR_GRAMMAR:
            if not req.grammar.ready:
                # Skipped, not blocking: those behind it may run (as vLLM).
                return Reason.GRAMMAR_COMPILING, 0, ""
            req.status = _WAITING
        if req.num_stale_output_tokens and not (self._drop_stale_output or req.drop_stale_output):
            # Preempted while a step of its was in flight (async mode):
            # resumed now, it could sample a position that output still
            # fills. Within the pipeline depth it drains.
            return Reason.OUTPUT_IN_FLIGHT, 0, ""
        if loras is not None and req.lora_id and req.lora_id not in loras and len(loras) >= max_loras:
            # Set aside, not stop: requests behind it may use a loaded adapter.
            return Reason.LORA_SLOTS, 0, f"{len(loras)} adapters in use"
        return None

    def _start_running(
        self,
        a: _Admissions,
        queue: WaitingQueue,
        req: Request,
        blocks: list,
        computed: int,
        n: int,
        hit: int,
        plan: EncoderPlan | None,
        held: str,
    ) -> None:
        """Admit the head with ``n`` tokens after ``computed`` (``hit`` < 0: no lookup)."""
        queue.pop()
        self._set_aside.discard(req)
        self.running.append(req)
        if computed < req.num_tokens - 1:
            a.prefill_admitted = True
        out = a.out
        kv = self.kv
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = computed
        req.status = _RUNNING
        req.num_computed_tokens = computed + n
        req.is_prefill_chunk = computed + n < req.num_tokens
        if self._remote is not None and req.is_prefill_chunk:
            self._remote.inflight_prefills.add(req)
        out.scheduled.append(req)
        out.num_scheduled_tokens.append(n)
        out.admitted.append(req)
        out.admitted_block_ids.append([b.block_id for b in blocks] if self.list_block_ids else [])
        out.admitted_num_cached_tokens.append(computed)
        out.admitted_resumed.append(req.num_preemptions > 0)
        if kv.pool.unwritten and hit > 0:
            start = kv.claim_unwritten(blocks[: hit // kv.block_size])
            if start is not None:
                out.recompute_from[req.request_id] = start
        if n > 1 and computed + 1 == req.num_tokens:
            # Padded: drafts that no proposer made, so none is accepted.
            out.spec_decode_tokens[req.request_id] = [-1] * (n - 1)
        if plan is not None:
            self._enc.commit(req, plan)
        if a.loras is not None and req.lora_id:
            a.loras.add(req.lora_id)
        if a.trace is not None:
            wanted = req.num_tokens - computed
            self._trace_scheduled(a.trace, req, computed, n, wanted, a.budget, a.threshold, True, held)
        a.budget -= n

    def _why_no_blocks(self, req: Request, hit_blocks: list, n: int, reserved: int) -> tuple[Reason, str]:
        kv = self.kv
        need = kv.blocks_to_admit(req, hit_blocks, n, self._lookahead)
        if self._reserve_full:
            need = max(need, kv.blocks_to_admit(req, hit_blocks, 0, full_sequence=True))
        free = kv.num_free_blocks
        if need <= free:
            return Reason.WATERMARK, f"needs {need} blocks, {free} free, {reserved} kept free"
        return Reason.KV_SHORT, f"needs {need} blocks, {free} free"

    def _unschedule(self, out: SchedulerOutput, victim: Request) -> int:
        """Take back a request met earlier in this step; returns the tokens it had been given."""
        scheduled = out.scheduled
        for k in range(len(scheduled) - 1, -1, -1):
            if scheduled[k] is victim:
                break
        else:
            # Passed over without tokens (deferred, nothing to compute, or
            # async mode's max_tokens already in flight).
            return 0
        n = out.num_scheduled_tokens[k]
        if self._enc is not None:
            self._enc.unschedule(victim)
        del out.scheduled[k]
        del out.num_scheduled_tokens[k]
        # The withdrawn chunk's blocks were registered in the prefix cache when
        # allocated, yet its KV is never computed. They stay findable, exactly
        # as in vLLM; whoever hits them later gets them recomputed.
        self.kv.mark_unwritten(victim, victim.num_computed_tokens - n)
        out.new_block_ids.pop(victim.request_id, None)
        out.spec_decode_tokens.pop(victim.request_id, None)
        if out.trace is not None:
            out.trace.entries = [e for e in out.trace.entries if e.request_id != victim.request_id]
        return n

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free the blocks, reset progress, queue again."""
        if self._remote is not None:
            self._remote.free(req)
            self._remote.forget(req)
        else:
            self.kv.free(req)
        if self._enc is not None and req.mm_items:
            self._enc.release(req)
        req.status = _PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        # Async mode: the output of its steps in flight still arrives and is
        # delivered, but as stale: it must not move the reset counters.
        # A session's dropped share still undrained stays dropped (its
        # positions were resampled); the rest is delivered.
        req.drop_stale_output = req.drop_stale_output and req.num_stale_output_tokens > 0
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        req.is_prefill_chunk = False
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(req)

    # ---- results -------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> StepOutputs:
        """Append sampled tokens, apply stop rules, roll back rejected drafts, free finished.

        In async mode ``out`` is the oldest step in flight, and the scheduler
        has planned a later step since: its placeholders are resolved here.
        """
        sampled = result.sampled_token_ids
        if len(sampled) != len(out.scheduled):
            raise ValueError(
                f"executor returned {len(sampled)} results for {len(out.scheduled)} scheduled requests"
            )
        remote = self._remote
        kv_out = result.kv_connector_output
        # Requests whose KV failed to load: their output is void (see RemoteKV.begin_update).
        failed = remote.begin_update(out, kv_out, self.running) if remote is not None else None
        res = StepOutputs()
        stopped_waiting = self._apply_sampled(out, result, failed, res)
        self._close_update(res, stopped_waiting, failed, kv_out)
        return res

    @staticmethod
    def _voided(req: Request, failed: set[str], drafts: Sequence[Sequence[int]] | None, k: int) -> bool:
        """Whether a failed KV load voided ``req``'s output; its drafts still reach it."""
        if req.request_id not in failed:
            return False
        if drafts is not None and not req.is_prefill_chunk:
            # vLLM hands the proposer's drafts over after the update, void output or not.
            req.spec_token_ids = list(drafts[k])
        return True

    def _apply_sampled(
        self, out: SchedulerOutput, result: ModelRunnerOutput, failed: set[str] | None, res: StepOutputs
    ) -> set[Request]:
        """Give each scheduled request its sampled tokens; returns those that stopped while waiting."""
        updated, finished, sampled = res.updated, res.finished, result.sampled_token_ids
        async_mode, has_drafts, enc = self._async, self._has_drafts, self._enc
        drafts = None if async_mode else result.draft_token_ids
        spec_sched = out.spec_decode_tokens
        stopped_waiting: set[Request] = set()
        for k, req in enumerate(out.scheduled):
            toks = sampled[k]
            status = req.status
            stale = False
            if async_mode:
                if status >= _FINISHED:
                    continue
                n = out.num_scheduled_tokens[k]
                req.num_in_flight_tokens -= n
                if req.num_stale_output_tokens:
                    stale = True
                    req.num_stale_output_tokens -= n
                    if self._drop_stale_output or req.drop_stale_output:
                        continue
            if failed and self._voided(req, failed, drafts, k):
                continue
            mm = enc is not None and req.mm_items
            if mm and not (spec_sched and toks):
                enc.release_passed(req)  # items its confirmed progress passed: no longer needed by it
            # No tokens: a partial prefill chunk. Not running (nor stale output): aborted meanwhile.
            if not toks or (status is not _RUNNING and not stale):
                continue
            if spec_sched:
                self._settle_drafts(req, spec_sched.get(req.request_id), len(toks), stale, bool(mm))
            if len(toks) == 1:
                t = toks[0]
                req.token_ids.append(t)
                req.num_tokens += 1
                stopped = (req.num_tokens >= req.stop_length or t in req.stop_ids) and check_stop(req, t)
            else:
                stopped = _append_tokens(req, toks, stale)
            if not stale:
                placeholders = req.num_output_placeholders
                if placeholders:
                    # Every returned token resolves one, those cut at a stop too.
                    req.num_output_placeholders = placeholders - len(toks)
                if placeholders or has_drafts:
                    # Tokens ran ahead of known values (placeholders, drafts), so allocation
                    # registered fewer blocks than are computed: register those now complete.
                    self.kv.cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)
            updated.append(req)
            if stopped:
                if mm:
                    # Released here, in output order: it decides the eviction order.
                    enc.release(req)
                finished.append(req)
                if stale:
                    stopped_waiting.add(req)
            elif drafts is not None and not req.is_prefill_chunk:
                req.spec_token_ids = list(drafts[k])
        return stopped_waiting

    def _settle_drafts(
        self, req: Request, scheduled_drafts: list[int] | None, num_sampled: int, stale: bool, mm: bool
    ) -> None:
        """Take back the positions (and placeholders) of the drafts a step rejected; release passed items."""
        if scheduled_drafts and not stale:
            rejected = len(scheduled_drafts) - (num_sampled - 1)
            if rejected > 0:
                req.num_computed_tokens -= rejected
                if req.num_output_placeholders:
                    req.num_output_placeholders -= rejected
        if mm:
            # Only now: its confirmed progress is known once rejected drafts are taken back.
            self._enc.release_passed(req)  # type: ignore[union-attr]

    def _close_update(
        self,
        res: StepOutputs,
        stopped_waiting: set[Request],
        failed: set[str] | None,
        kv_out: KVConnectorOutput | None,
    ) -> None:
        """Free what finished: stopped, declined by the policy, mismatched encoder inputs, failed loads."""
        finished = res.finished
        if finished:
            self._remove_stopped(finished, stopped_waiting)
        if self._declined:
            finished.extend(self._declined)
            self._declined = []
        enc = self._enc
        if enc is not None and enc.mismatched:
            mismatched, enc.mismatched = enc.mismatched, set()
            finished.extend(self.finish_requests(mismatched, RequestStatus.FINISHED_ERROR))
        remote = self._remote
        if remote is not None:
            if failed and not remote.recompute_failures:
                finished.extend(self.finish_requests(failed, RequestStatus.FINISHED_ERROR))
            remote.end_update(kv_out)
        if self._debug:
            self._check_kv_invariants()

    def _remove_stopped(self, finished: list[Request], stopped_waiting: set[Request]) -> None:
        """Take requests that stopped out of their queues and free them."""
        if stopped_waiting:
            # Stale output finished a preempted request while it waited.
            self._remove_waiting(stopped_waiting)
        num_running = len(finished) - len(stopped_waiting)
        if num_running:
            running = self.running
            if num_running <= 8:
                for req in finished:
                    if req not in stopped_waiting:
                        running.remove(req)
            else:
                self.running = [r for r in running if r.status is _RUNNING]
        for req in finished:
            if req.resumable and not self.sessions.on_stopped(req):
                # A session's turn ended: it keeps its KV for the next input.
                (self.holding if _holds_blocks(req) else self.waiting).add(req)
            else:
                self._release(req)

    # ---- decision trace --------------------------------------------------------

    def _trace_scheduled(
        self,
        trace: StepTrace,
        req: Request,
        start: int,
        n: int,
        wanted: int,
        budget: int,
        threshold: int,
        admitted: bool = False,
        held: str = "",
    ) -> None:
        if start >= req.num_tokens - 1:
            what = "decode" if n == 1 else f"decode with {n - 1} draft tokens"
        else:
            what = (
                f"{'recompute' if req.num_preemptions else 'prefill'} {start}-{start + n} of {req.num_tokens}"
            )
        if admitted:
            what = (
                ("resumed" if req.num_preemptions else "admitted")
                + (f" with a prefix-cache hit of {start} tokens, " if start else ", ")
                + what
            )
            if req.skip_prefix_cache and self.kv.enable_caching:
                what += f", {PREFIX_CACHE_NOT_READ}"
        if n < wanted:
            if threshold and n == threshold:
                what += f", capped by long_prefill_token_threshold={threshold}"
            elif n == budget:
                what += ", capped by the token budget"
            elif held:
                what += f", stopped before {held}"
            else:
                what += f", capped by max_model_len={self._max_model_len}"
        trace.add(req.request_id, Reason.SCHEDULED, n, what)

    def _trace_waiting(
        self,
        trace: StepTrace,
        set_aside: list[Request] | None,
        head_reason: Reason,
        detail: str,
        whole_queue: bool = False,
    ) -> None:
        """Explain the waiting requests this step did not admit.

        ``whole_queue``: the reason applies to every waiting request (a gate,
        a preempting step), not only to the head the others queue behind.
        """
        head: Request | None = None
        listed = 0
        skip = set(set_aside or ())
        for req in self.waiting:
            if req in skip:
                continue
            if head is None:
                head = req
                trace.add(req.request_id, head_reason, detail=detail)
            elif listed < MAX_LISTED_WAITING:
                listed += 1
                if whole_queue:
                    trace.add(req.request_id, head_reason, detail=detail)
                else:
                    trace.add(req.request_id, Reason.QUEUED, detail=f"behind {head.request_id}")
            else:
                trace.num_unlisted_waiting += 1

    # ---- invariants ----------------------------------------------------------

    def _check_invariants(self, out: SchedulerOutput) -> None:
        total = out.total_num_scheduled_tokens
        assert total == sum(out.num_scheduled_tokens), (
            f"scheduled-token counter {total} != sum {sum(out.num_scheduled_tokens)}"
        )
        assert total <= self._max_tokens_budget, f"{total} tokens exceed the budget"
        assert len(self.running) <= self._max_num_seqs, f"{len(self.running)} running"
        assert len({r.request_id for r in out.scheduled}) == len(out.scheduled), "request scheduled twice"
        for req in out.scheduled:
            assert req.status is _RUNNING, f"{req} scheduled but not running"
        self._check_kv_invariants()

    def _check_kv_invariants(self) -> None:
        if self._remote is not None:
            self.kv.check_invariants(self._remote.detached_tables())
        else:
            self.kv.check_invariants()
