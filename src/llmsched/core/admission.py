"""Admission: one step's pass over the waiting queues.

The scheduler serves its running requests first; what budget, sequence
slots and KV blocks they leave goes to waiting requests, in policy order:
those holding KV blocks (sessions between turns, connector loads) first,
then the rest. The head of a queue is set aside for a reason of its own
(a grammar compiling, a load in progress, LoRA slots) so those behind it
may go, refused by the policy, or admitted: prefix-cache lookup, the
connector's part, the chunk, KV allocation (preempting for it where the
policy decides), and start. Admissions stop at the first head that does
not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmsched.core.encoder_inputs import EncoderPlan
from llmsched.core.output import SchedulerOutput
from llmsched.core.policy import Verdict, WaitingQueue
from llmsched.core.request import Request, RequestStatus
from llmsched.core.scheduler_host import SchedulerHost
from llmsched.core.trace import Reason, StepTrace, trace_scheduled, trace_waiting

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_GRAMMAR
_WAITING_FOR_INPUT = RequestStatus.WAITING_FOR_INPUT
_NO_BLOCKS: list = []


def holds_blocks(req: Request) -> bool:
    """Whether a waiting request holds KV blocks (it then queues in ``holding``)."""
    return req.num_computed_tokens > 0 or req.status is _REMOTE


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
    # Requests preempted for a waiting one that their queue put back ahead
    # of it (a queue that puts preempted requests first): out of the way
    # until the pass ends, then back at the head.
    victims: list[Request] = field(default_factory=list)
    # Why admissions stop at a request (None: they did not).
    stop: Reason | None = None
    detail: str = ""
    prefill_admitted: bool = False


class Admission:
    """Admits one scheduler's waiting requests into a step.

    Made by the scheduler after its settings and connector: it keeps the
    settings and the queues, KV cache manager and policy, which never
    change, and reads the running list, the encoder scheduler and whether
    block ids are listed from the scheduler when it needs them. It calls
    back the scheduler's ``_preempt``, ``_unschedule``, ``_release`` and
    ``_aligned_chunk``, and adds declined requests to its ``_declined``.
    """

    def __init__(self, s: SchedulerHost) -> None:
        self.sched = s
        self.kv = s.kv
        self.policy = s.policy
        self.waiting = s.waiting
        self.holding = s.holding
        self.sessions = s.sessions
        self._set_aside = s._set_aside
        self._remote = s._remote
        self._drop_stale_output = s._drop_stale_output
        self._max_num_seqs = s._max_num_seqs
        self._max_loras = s._max_loras
        self._max_tokens_budget = s._max_tokens_budget
        self._max_model_len = s._max_model_len
        self._has_drafts = s._has_drafts
        self._pad_drafts = s.config.pad_draft_admissions
        self._num_drafts = s.config.num_speculative_tokens
        self._mamba_align = s._mamba_align
        self._watermark_blocks = s._watermark_blocks
        self._reserve_full = s._reserve_full
        self._lookahead = s._lookahead
        self._chunked = s._chunked

    def admit(
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
        running = self.sched.running
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
                freed = self._preempt_for(a, queue, req) if decides else None
                if freed is None:
                    a.stop, a.detail = Reason.MAX_NUM_SEQS, f"{len(running)} running"
                    break
                a.budget += freed
            if not self._admit_head(a, queue, req):
                break
        if a.set_aside or a.victims:
            waiting.requeue(a.victims + a.set_aside)
        if a.held_aside:
            holding.requeue(a.held_aside)
        if trace is not None and len(waiting):
            stop, detail = a.stop, a.detail
            if stop is None:
                stop, detail = Reason.BUDGET, f"all {self._max_tokens_budget} tokens of the step are used"
            trace_waiting(trace, self.waiting, a.set_aside, stop, detail)
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
        (a.held_aside if holds_blocks(req) else a.set_aside).append(req)
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
            and self._pad_drafts
            and not a.prefill_running
            and (computed > 0 or len(out.scheduled) > len(out.admitted))
        )
        n, stop, detail = self._admission_chunk(req, computed, a.budget, a.threshold, a.defer, pad)
        if stop is not None:
            self._blocked(a, queue, req, stop, detail)
            return None
        if self._mamba_align:
            n = self.sched._aligned_chunk(req, computed, n)
            if n == 0:
                a.stop, a.detail = Reason.MAMBA_ALIGNMENT, f"{a.budget} tokens left"
                return None
        enc = self.sched._enc
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
            reserved = self._watermark_blocks if self.sched.running else 0
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
            freed = self._preempt_for(a, queue, req)
            if freed is None:
                break
            a.budget += freed
        if blocks is None:
            if self.sched._enc is not None and req.mm_items:
                self.sched._enc.release(req)
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

    def _preempt_for(self, a: _Admissions, queue: WaitingQueue, req: Request) -> int | None:
        """Preempt the running request the policy picks to make room for ``req``, the head of ``queue``.

        Returns the tokens the victim had been given this step, or None when
        the policy picks none. Requests admitted this step are never victims.
        """
        out, trace = a.out, a.trace
        admitted = out.admitted
        candidates = (
            [r for r in self.sched.running if r not in admitted] if admitted else list(self.sched.running)
        )
        victim = self.policy.select_victim(candidates, req) if candidates else None
        if victim is None or (self._remote is not None and not self._remote.can_preempt(victim)):
            return None
        self.sched.running.remove(victim)
        freed = self.sched._unschedule(out, victim)
        self.sched._preempt(victim)
        if queue.peek() is victim:
            # The victim went back ahead of req: req is admitted first.
            a.victims.append(queue.pop())
        out.preempted.append(victim)
        if trace is not None:
            trace.add(victim.request_id, Reason.PREEMPTED_FOR_WAITING, detail=f"for {req.request_id}")
        return freed

    def _decline(self, req: Request) -> None:
        """Finish a waiting request (already out of its queue) that the policy will not serve."""
        self._set_aside.discard(req)
        req.status = RequestStatus.FINISHED_ABORTED
        req.stop_reason = "declined"
        self.sched._release(req)
        self.sched._declined.append(req)

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
            padded = 1 + self._num_drafts
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
        self.sched.running.append(req)
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
        out.admitted_block_ids.append([b.block_id for b in blocks] if self.sched.list_block_ids else [])
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
            self.sched._enc.commit(req, plan)
        if a.loras is not None and req.lora_id:
            a.loras.add(req.lora_id)
        if a.trace is not None:
            wanted = req.num_tokens - computed
            trace_scheduled(
                a.trace,
                req,
                computed,
                n,
                wanted,
                a.budget,
                a.threshold,
                self._max_model_len,
                held,
                True,
                kv.enable_caching,
            )
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
