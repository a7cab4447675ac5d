"""Applying a step's output: sampled tokens, stop rules, rejected drafts, finishes.

Each scheduled request gets the tokens its step sampled (a decode and its
accepted drafts), up to a stop; the positions of rejected drafts are taken
back; in async mode the step's placeholders are resolved, and output that
arrives for a request preempted meanwhile is delivered as stale without
moving its counters. What finished (stopped, declined by the policy,
mismatched encoder inputs, failed KV loads) is freed.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmsched.core.connector import KVConnectorOutput
from llmsched.core.output import ModelRunnerOutput, SchedulerOutput, StepOutputs
from llmsched.core.request import Request, RequestStatus, check_stop
from llmsched.core.scheduler_host import SchedulerHost

_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED_STOPPED  # this and every later status are terminal


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


class StepUpdate:
    """Applies executed steps' outputs to one scheduler's requests.

    Made by the scheduler after its settings and connector: it keeps the
    settings, the KV cache manager and the connector's scheduler side, and
    reads the running list, the encoder scheduler and the declined requests
    from the scheduler. It calls back the scheduler's ``finish_requests``,
    ``_remove_stopped`` and ``_check_kv_invariants``.
    """

    def __init__(self, s: SchedulerHost) -> None:
        self.sched = s
        self.kv = s.kv
        self._remote = s._remote
        self._async = s._async
        self._has_drafts = s._has_drafts
        self._drop_stale_output = s._drop_stale_output
        self._debug = s._debug

    def apply(self, out: SchedulerOutput, result: ModelRunnerOutput) -> StepOutputs:
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
        failed = remote.begin_update(out, kv_out, self.sched.running) if remote is not None else None
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
        async_mode, has_drafts, enc = self._async, self._has_drafts, self.sched._enc
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
            self.sched._enc.release_passed(req)  # type: ignore[union-attr]

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
            self.sched._remove_stopped(finished, stopped_waiting)
        if self.sched._declined:
            finished.extend(self.sched._declined)
            self.sched._declined = []
        enc = self.sched._enc
        if enc is not None and enc.mismatched:
            mismatched, enc.mismatched = enc.mismatched, set()
            finished.extend(self.sched.finish_requests(mismatched, RequestStatus.FINISHED_ERROR))
        remote = self._remote
        if remote is not None:
            if failed and not remote.recompute_failures:
                finished.extend(self.sched.finish_requests(failed, RequestStatus.FINISHED_ERROR))
            remote.end_update(kv_out)
        if self._debug:
            self.sched._check_kv_invariants()
