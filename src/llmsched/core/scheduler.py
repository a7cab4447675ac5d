"""The step scheduler: which requests run how many tokens, and KV for them.

There is no prefill or decode phase. A request holds ``num_tokens`` (prompt
plus generated, plus draft tokens) and ``num_computed_tokens``; each step
hands out tokens so that computed catches up with total, a prefill chunk and
a decode being the same operation with a different count. Running requests
are served first, in running order; waiting ones are admitted only while
budget, sequence slots and KV blocks remain, and never in a step that had to
preempt. In its default configuration every decision equals vLLM V1's.

The scheduler holds the queues and runs the step's phases; admission of the
waiting queues (``core.admission``) and applying a step's output
(``core.step_update``) are collaborators it makes, and the decision trace's
explanations are written by ``core.trace``. The simulator's plain-decode
shortcuts (``core.plain_decodes``) apply steps through the few methods in
the section marked for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from llmsched.core.admission import Admission, holds_blocks
from llmsched.core.config import SchedulerConfig
from llmsched.core.connector import KVConnector
from llmsched.core.encoder_inputs import EncoderPlan, EncoderScheduler
from llmsched.core.errors import RequestRejected
from llmsched.core.kv.hybrid import HybridKVCacheManager
from llmsched.core.kv.mamba import mamba_aligned_chunk
from llmsched.core.kv.manager import KVCacheManager, PrefixCacheStats, cdiv
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput, StepOutputs
from llmsched.core.policy import Policy, make_policy
from llmsched.core.remote_kv import RemoteKV
from llmsched.core.request import Request, RequestStatus
from llmsched.core.session import Sessions
from llmsched.core.step_update import StepUpdate
from llmsched.core.trace import Reason, StepTrace, trace_scheduled, trace_unreached, trace_waiting

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED
_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_GRAMMAR
_WAITING_FOR_INPUT = RequestStatus.WAITING_FOR_INPUT


# An admission gate returns None to allow admissions this step, or a short
# explanation of why none may happen. The trace files it under the gate's
# ``reason`` attribute when it has one, else under ADMISSION_GATED.
AdmissionGate = Callable[["Scheduler"], "str | None"]


def _schedule_drafts(out: SchedulerOutput, req: Request, num_drafts: int) -> None:
    """List the drafts a scheduled chunk reaches; fresh ones arrive with this step's output."""
    if num_drafts > 0:
        out.spec_decode_tokens[req.request_id] = req.spec_token_ids[:num_drafts]
    req.spec_token_ids = []


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
        self._admission = Admission(self)
        self._update = StepUpdate(self)
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
        out = self._open_step()
        trace = StepTrace(out.step) if self._trace_enabled else None
        out.trace = trace
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
                trace_waiting(trace, self.waiting, None, Reason.PREEMPTION_STEP, "", whole_queue=True)
        else:
            budget, prefill_admitted = self._schedule_waiting(
                out, trace, budget, threshold, defer, num_waiting, prefill_scheduled
            )
        self._close_step(out, budget, prefill_scheduled or prefill_admitted)
        return out

    @property
    def next_step(self) -> int:
        """The number the next scheduled step will carry."""
        return self._step

    def _open_step(self) -> SchedulerOutput:
        """The next step's output, numbered, carrying the ids finished since the last step."""
        out = SchedulerOutput(self._step)
        self._step += 1
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        return out

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
                trace_scheduled(trace, req, computed, n, wanted, budget, threshold, max_len, held)
            budget -= n
            i += 1
        if trace is not None:
            trace_unreached(trace, running[i:])
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
                trace_waiting(trace, self.waiting, None, reason, why_gated, whole_queue=True)
            return budget, False
        prefill_admitted = False
        if num_waiting:
            budget, prefill_admitted = self._admission.admit(
                out, budget, threshold, defer, trace, prefill_running
            )
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
        return self._update.apply(out, result)

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
                (self.holding if holds_blocks(req) else self.waiting).add(req)
            else:
                self._release(req)

    # ---- steps decided outside schedule() (core.plain_decodes) ---------------

    def _admit_behind(self, out: SchedulerOutput, num_running: int, num_scheduled: int) -> int:
        """Admit the queue into ``out``, a step whose running requests took ``num_scheduled`` tokens.

        As schedule() admits in a step that neither preempts nor defers
        (no cadence), and closes the step's totals; returns its tokens.
        """
        num_waiting = len(self.waiting)
        threshold = self._threshold if num_running + num_waiting > 1 else 0
        budget = self._max_tokens_budget - num_scheduled
        if num_waiting:
            budget = self._admission.admit(out, budget, threshold, False, None)[0]
        self._prefill_capacity_bound = self.num_waiting > len(self._set_aside)
        out.total_num_scheduled_tokens = total = self._max_tokens_budget - budget
        if total:
            self._num_executed_steps += 1
        return total

    def _steps_applied(self, num_steps: int) -> None:
        """Count ``num_steps`` steps of decodes alone, applied outside schedule() with nothing waiting."""
        # The first one's finished_req_ids go with it, unread.
        self._finished_ids = []
        self._step += num_steps
        self._num_executed_steps += num_steps
        # What a schedule() with an empty queue sets.
        self._prefill_capacity_bound = False

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
