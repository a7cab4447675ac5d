"""Plain decode steps applied without building their batches: the simulator's shortcuts.

A plain decode step schedules one token for every running request and does
nothing else a later step could read differently. ``PlainDecodes`` proves
steps (engine calls, in async mode) plain and applies them, leaving exactly
the state ``Scheduler.schedule()`` then ``update_from_output()`` would; it
also runs the steps that admit others while the running requests are kept
lazily as a ``DecodeCohort`` (``AsyncDecodeCohort``). Only the simulator
constructs one: the scheduler itself never calls it.

It reads the scheduler's configuration once, its queues (``running``,
``waiting``, ``holding``), ``kv``, ``policy``, ``admission_gate`` and
``next_step``, and three pieces of its state: whether a trace is on,
whether encoder inputs exist, and the requests declined or finished since
the last step. It changes the scheduler's state only through
``_open_step``, ``_admit_behind``, ``_steps_applied`` and ``_remove_stopped``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmsched.core.decode_cohort import (
    AsyncDecodeCohort,
    DecodeCohort,
    advance_async_decodes,
    in_flight_plainly,
    plain_async_decode,
)
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.core.request import Request, RequestStatus, check_stop

if TYPE_CHECKING:
    from llmsched.core.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED_STOPPED  # this and every later status are terminal


class PlainDecodes:
    """Proves coming steps plain decodes and applies them to one scheduler's state."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        cfg = sched.config
        self._async = cfg.async_scheduling
        # What makes every step do more than schedule decodes (the trace is switched at run time).
        self._more = (
            sched.connector is not None
            or cfg.num_speculative_tokens > 0
            or bool(cfg.num_lookahead_tokens)
            or cfg.mamba
        )
        self._debug = cfg.debug
        self._cadence = cfg.prefill_schedule_interval > 1
        self._lora_slots = cfg.max_loras is not None
        self._mamba_align = cfg.mamba and cfg.enable_prefix_caching
        self._budget = cfg.max_num_batched_tokens
        self._max_len = cfg.max_model_len

    def _step_does_more(self) -> bool:
        """Whether a step does more than schedule decodes (connector, drafts, lookahead, trace, hybrid)."""
        return self._more or self.sched._trace_enabled

    def _steps_may_be_plain(self) -> bool:
        """False where a step always does more than schedule what it is asked (see ``plain_decode_steps``)."""
        return not (self._async or self._step_does_more())

    def _admits_plainly(self) -> bool:
        """Whether admissions are the plain FCFS kind a cohort's steps keep beside lazy decodes."""
        sched = self.sched
        return not (
            sched.policy.decides_admission
            or sched.admission_gate is not None
            or self._cadence
            or self._lora_slots
            or sched._enc is not None
            or self._mamba_align
            or self._debug
            or sched._declined
            or len(sched.holding)
            or len(sched.running) > self._budget
        )

    def _fits(self, k: int) -> int:
        """``k`` if the free blocks cover every running table's growth over ``k`` decodes, else 0."""
        if k <= 0:
            return 0
        kv = self.sched.kv
        need = 0
        for r in self.sched.running:
            need += kv.decode_blocks_needed(r, k)
        return k if need <= kv.num_free_blocks else 0

    # ---- sync mode -------------------------------------------------------------

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
        sched = self.sched
        running = sched.running
        if (
            not self._steps_may_be_plain()
            or (sched._finished_ids and not finished_ids_unread)
            or len(sched.waiting)
            or len(sched.holding)
            or not running
            or len(running) > self._budget
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
            and sched._enc is None
            and not sched._declined
            and not any(r.resumable for r in running if r.stop_length - r.num_tokens - 1 == k)
        ):
            k += 1
        return self._fits(k)

    def advance_decode_steps(self, num_steps: int, token_id: int) -> list[Request]:
        """Apply ``num_steps`` plain decode steps (see ``plain_decode_steps``) with ``token_id`` sampled.

        Each step leaves the state ``schedule()`` then ``update_from_output()``
        would: the step counters advance, every running request computes one
        token (its KV slots allocated in running order, as schedule() does,
        wherever the allocation adds or registers a block) and appends the
        sampled token. Returns the requests the last step finished, in
        running order (only a run ``through_finish`` ends finishing any).
        """
        cohort = DecodeCohort(self.sched.kv, token_id)
        for r in self.sched.running:
            cohort.join(r)
        finished = self.advance_cohort(cohort, num_steps)
        cohort.flush()
        return finished

    # ---- sync decode cohorts: plain decodes kept lazily across admitting steps ---

    def start_cohort(self, token_id: int) -> DecodeCohort | None:
        """A DecodeCohort of every running request, if ``cohort_schedule`` can serve the coming steps.

        Besides what plain steps need, admissions must be the plain FCFS
        kind (no policy that preempts, declines or reorders, no gate, no
        cadence, no LoRA slots, no encoder inputs), so that a step's decodes
        stay one token each whatever is admitted behind them. None when any
        running request is not a plain decode (or could stop on ``token_id``,
        or is a session).
        """
        if not self._steps_may_be_plain() or not self._admits_plainly():
            return None
        running = self.sched.running
        for r in running:
            if (
                r.is_prefill_chunk
                or r.num_tokens != r.num_computed_tokens + 1
                or token_id in r.stop_ids
                or r.resumable
            ):
                return None
        cohort = DecodeCohort(self.sched.kv, token_id)
        for r in running:
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
        sched = self.sched
        d = len(sched.running)
        if not d or d != len(cohort) or len(sched.waiting) or len(sched.holding):
            return 0
        kv = sched.kv
        k = min(
            limit, int(cohort.next_finish()) - cohort.steps + 1, (kv.num_free_blocks // d) * kv.block_size - 1
        )
        return k if k > 0 else 0

    def advance_cohort(self, cohort: DecodeCohort, num_steps: int) -> list[Request]:
        """Apply ``num_steps`` plain decode steps (see ``cohort_plain_steps``) to ``cohort``.

        Returns the requests the last step finished, freed.
        """
        finished = cohort.advance(num_steps)
        # The first step's finished_req_ids (see plain_decode_steps) go with the steps.
        self.sched._steps_applied(num_steps)
        if finished:
            # update_from_output's stop check and removal, in its order.
            for r in finished:
                check_stop(r, cohort.token_id)
            self.sched._remove_stopped(finished, set())
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
        sched = self.sched
        d = len(sched.running)
        if (
            d != len(cohort)
            or len(sched.holding)
            or d > self._budget
            # One new block per member at most (see cohort_plain_steps).
            or d > sched.kv.num_free_blocks
        ):
            return None
        out = sched._open_step()
        finishing = cohort.advance(1)
        sched._admit_behind(out, d, d)
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
            self.sched._remove_stopped(finished, set())
        return samplers, finished

    # ---- async mode --------------------------------------------------------------

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
        sched = self.sched
        running = sched.running
        if (
            not self._async
            or self._step_does_more()
            or self._debug
            or sched._enc is not None
            or self._cadence
            or sched._declined
            or len(sched.waiting)
            or len(sched.holding)
            or not running
            or len(running) > self._budget
        ):
            return 0
        k = limit
        for r in running:
            if not in_flight_plainly(r, token_id):
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
        return self._fits(k)

    def advance_async_decode_steps(
        self, num_steps: int, token_id: int, through_finish: bool = False
    ) -> list[Request]:
        """Apply ``num_steps`` calls proven plain by ``async_plain_decode_steps``, ``token_id`` sampled.

        Leaves the state those calls' schedule() and update_from_output()
        would: the last call's step in flight, every request with one
        placeholder. Returns the requests the last call finished, in running
        order (only a run ``through_finish`` finishes any).
        """
        sched = self.sched
        finished = advance_async_decodes(sched.kv, sched.running, num_steps, token_id, through_finish)
        sched._steps_applied(num_steps)
        if finished:
            self._finish_last(finished, token_id)
        return finished

    def _finish_last(self, finished: list[Request], token_id: int) -> None:
        """update_from_output's resolution, registration, stop check and removal, in its order."""
        kv = self.sched.kv
        for r in finished:
            r.num_output_placeholders = 0
            r.num_in_flight_tokens = 0
            check_stop(r, token_id)
            kv.cache_blocks(r, r.num_computed_tokens)
        self.sched._remove_stopped(finished, set())

    # ---- async decode cohorts ------------------------------------------------------

    def start_async_cohort(self, token_id: int, in_flight: SchedulerOutput) -> AsyncDecodeCohort | None:
        """An AsyncDecodeCohort of every running request, if ``async_cohort_schedule`` can serve the calls.

        As ``start_cohort`` in sync mode, with async mode's own conditions:
        ``in_flight`` (the one step in flight) decoded every running request
        one token, and each is a ``plain_async_decode``.
        """
        sched = self.sched
        running = sched.running
        if (
            not self._async
            or self._step_does_more()
            or not self._admits_plainly()
            or len(in_flight.scheduled) != len(running)
            or in_flight.total_num_scheduled_tokens != len(running)
            or in_flight.preempted
            or sched.next_step != in_flight.step + 1
        ):
            return None
        for r, s in zip(running, in_flight.scheduled):
            if r is not s or not plain_async_decode(r, token_id):
                return None
        cohort = AsyncDecodeCohort(sched.kv, token_id)
        for r in running:
            cohort.join(r)
        cohort.num_in_flight = len(running)
        return cohort

    def _tail_skips(self, tail: list[Request]) -> list[bool] | None:
        """For each request behind the members, whether the coming call skips it; None if any is no decode."""
        max_len = self._max_len
        skips = []
        for r in tail:
            if (
                r.status is not _RUNNING
                or r.is_prefill_chunk
                or r.num_output_placeholders != 1
                or r.num_tokens != r.num_computed_tokens
                or r.spec_token_ids
                or r.num_stale_output_tokens
            ):
                return None
            computed = r.num_computed_tokens
            # schedule()'s in-flight skip (the step in flight brings it to max_tokens), or no position left.
            skips.append(computed + 1 >= r.num_prompt_tokens + r.max_tokens or computed + 1 >= max_len)
        return skips

    def async_cohort_schedule(
        self, cohort: AsyncDecodeCohort
    ) -> tuple[SchedulerOutput, list[Request], int, int] | None:
        """schedule() for an async call in which the members decode and the rest runs schedule()'s code.

        The members (the head of the running queue) get one token each, but
        those the call finishes; the requests behind them must each decode one
        token after their first sample (anything else: None, nothing changed);
        then the queue is admitted. The output lists every scheduled request,
        as schedule()'s; the members' new blocks are not listed. Returns it,
        the members it finishes (``finishing()``), how many members it decodes
        and their summed computed counts after it.
        """
        sched = self.sched
        running = sched.running
        d = len(running)
        m = len(cohort)
        if (
            len(sched.holding)
            or d > self._budget
            # A new block at most for each member whose event falls on this
            # call and for each request behind them: no allocation fails,
            # nobody is preempted.
            or cohort.events_due() + d - m > sched.kv.num_free_blocks
        ):
            return None
        tail = running[m:]
        skips = self._tail_skips(tail)
        if skips is None:
            return None
        finishing = cohort.finishing()
        if len(finishing) == m and all(skips):
            return None  # nothing would run: the engine would not hand the step over
        out = sched._open_step()
        context = cohort.schedule(finishing)
        decodes = m - len(finishing)
        if finishing:
            gone = set(finishing)
            out.scheduled = [r for r in running[:m] if r not in gone]
        else:
            out.scheduled = running[:m]
        out.num_scheduled_tokens = [1] * decodes
        self._schedule_tail(out, tail, skips, d)
        listed = out.scheduled
        sched._admit_behind(out, d, len(listed))
        # What _mark_in_flight does, for the requests behind the members (theirs stay lazily as they are).
        for req, n in zip(listed[decodes:], out.num_scheduled_tokens[decodes:]):
            req.num_in_flight_tokens += n
            if not req.is_prefill_chunk:
                req.num_output_placeholders += 1
        return out, finishing, decodes, context

    def _schedule_tail(self, out: SchedulerOutput, tail: list[Request], skips: list[bool], d: int) -> None:
        """schedule()'s running phase for the decodes behind the members: one token each but the skipped."""
        kv = self.sched.kv
        listed = out.scheduled
        for r, skip in zip(tail, skips):
            if skip:
                continue
            new_blocks = kv.allocate_slots(r, 1)
            if new_blocks is None:
                raise AssertionError(f"{r.request_id}: no block for one token with {d} free")
            r.num_computed_tokens += 1
            r.is_prefill_chunk = False
            listed.append(r)
            out.num_scheduled_tokens.append(1)
            if new_blocks:
                out.new_block_ids[r.request_id] = [b.block_id for b in new_blocks]

    def async_cohort_update(
        self,
        cohort: AsyncDecodeCohort,
        so: SchedulerOutput,
        result: ModelRunnerOutput,
        finishing: list[Request],
        decodes: int,
    ) -> tuple[list[Request], int, list[Request]]:
        """update_from_output() of the step in flight ``so``, in a call ``async_cohort_schedule`` made.

        Its first ``cohort.num_in_flight`` entries are members, as are those
        behind them that joined since: their update is lazy but for
        ``finishing``. The others go through update_from_output()'s code.
        Requests right behind the members that now decode plainly join them.
        Returns the requests updated by that code, how many members sampled,
        and every request the step finished, in update order.
        """
        token = cohort.token_id
        kv = self.sched.kv
        scheduled = so.scheduled
        lazy = cohort.num_in_flight
        # Behind the members scheduled then: those that joined since (lazy too), and the others.
        others = [k for k in range(lazy, len(scheduled)) if scheduled[k] not in cohort]
        lazy = len(scheduled) - len(others)
        cohort.finish(finishing)
        finished = finishing
        for r in finished:
            r.num_output_placeholders = 0
            r.num_in_flight_tokens = 0
            check_stop(r, token)
            kv.cache_blocks(r, r.num_computed_tokens)
        samplers = self._update_others(so, result, others, finished)
        if finished:
            self.sched._remove_stopped(finished, set())
        for r in self.sched.running[len(cohort) :]:
            # It sampled here (a prompt's first token counts as no decode yet).
            if not plain_async_decode(r, token) or r.num_tokens <= r.num_prompt_tokens:
                break
            cohort.join(r)
        cohort.num_in_flight = decodes
        return samplers, lazy, finished

    def _update_others(
        self, so: SchedulerOutput, result: ModelRunnerOutput, others: list[int], finished: list[Request]
    ) -> list[Request]:
        """update_from_output()'s code for the entries ``others`` of ``so``; the samplers (adds finishers)."""
        kv = self.sched.kv
        sampled = result.sampled_token_ids
        scheduled = so.scheduled
        samplers: list[Request] = []
        for k in others:
            req = scheduled[k]
            status = req.status
            if status >= _FINISHED:
                continue
            req.num_in_flight_tokens -= so.num_scheduled_tokens[k]
            toks = sampled[k]
            if not toks or status is not _RUNNING:
                continue
            t = toks[0]
            req.token_ids.append(t)
            req.num_tokens += 1
            stopped = (req.num_tokens >= req.stop_length or t in req.stop_ids) and check_stop(req, t)
            placeholders = req.num_output_placeholders
            if placeholders:
                req.num_output_placeholders = placeholders - 1
                kv.cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)
            samplers.append(req)
            if stopped:
                finished.append(req)
        return samplers

    def async_cohort_plain_calls(self, cohort: AsyncDecodeCohort, limit: int) -> int:
        """How many of the next calls (at most ``limit``) are plain decodes of ``cohort``.

        ``async_plain_decode_steps`` for a cohort, without a pass over it: every
        running request is a member and nothing waits. The calls run through
        the one that finishes the next members, unless that would finish every
        member (its step would schedule nothing). While the free blocks cover
        k // block_size + 1 new blocks per member, no allocation can fail.
        """
        sched = self.sched
        d = len(sched.running)
        if not d or d != len(cohort) or len(sched.waiting) or len(sched.holding):
            return 0
        kv = sched.kv
        k = min(
            limit, int(cohort.next_finish()) - cohort.steps + 1, (kv.num_free_blocks // d) * kv.block_size - 1
        )
        if k > 0 and len(cohort.finishing(k - 1)) == d:
            k -= 1
        return k if k > 0 else 0

    def advance_async_cohort(
        self, cohort: AsyncDecodeCohort, num_calls: int, finishing: list[Request]
    ) -> SchedulerOutput:
        """Apply ``num_calls`` calls proven plain by ``async_cohort_plain_calls``; the last one's step.

        ``finishing``: the members the last call finishes (``cohort.finishing(num_calls - 1)``;
        none if the run stops before the call that finishes the next ones).
        They are freed; the step left in flight lists the other members.
        """
        sched = self.sched
        m = len(cohort)
        cohort.run(num_calls, finishing)
        sched._steps_applied(num_calls)
        if finishing:
            self._finish_last(finishing, cohort.token_id)
            m = len(sched.running)
        cohort.num_in_flight = m
        return SchedulerOutput(sched.next_step - 1, sched.running[:m], [1] * m, m)
