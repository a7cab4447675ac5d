"""The scheduler's bookkeeping for a KV connector: loads, failures, held and deferred blocks.

The scheduler owns one of these only when it has a connector; without one
none of this runs. Every rule below is vLLM V1's (its scheduler's
connector path), so that decisions stay equal to vLLM's with a connector.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from llmsched.core.connector import KVConnector, KVConnectorOutput
from llmsched.core.kv.block import KVBlock
from llmsched.core.kv.manager import KVCacheManager
from llmsched.core.output import SchedulerOutput
from llmsched.core.policy_seam import WaitingQueue
from llmsched.core.request import Request, RequestStatus
from llmsched.core.trace import Reason, StepTrace

_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS


class RemoteKV:
    """State of the connector path, and the steps of it the scheduler delegates."""

    def __init__(
        self,
        connector: KVConnector,
        kv: KVCacheManager,
        holding: WaitingQueue,
        async_scheduling: bool,
        spec_tokens: int,
        lookahead: int,
    ) -> None:
        self.connector = connector
        cfg = connector.transfer_config
        self.kv = kv
        # Waiting requests that hold blocks (an async load in progress or
        # done): always considered before the ordinary waiting queue, so a
        # load that finished is admitted before new work.
        self.holding = holding
        self.recompute_failures = cfg.load_failure_policy == "recompute"
        # A producer must not hand off KV that a preemption freed: the
        # output still in flight for a preempted request is dropped, not
        # delivered, so the request may resume at once.
        self.drop_stale_output = async_scheduling and cfg.is_producer
        # With a step in flight, a consumer's load may fill a block that the
        # in-flight step still writes: blocks freed meanwhile return to the
        # pool only once every step that scheduled their request is applied.
        self.defer_frees = async_scheduling and cfg.is_consumer
        self.sched_seq = 0
        self.processed_seq = 0
        self.last_sched_seq: dict[Request, int] = {}
        self.deferred_frees: deque[tuple[int, list[KVBlock]]] = deque()
        # Loads reported finished (or failed) and not yet acted on.
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        # Requests still prefilling (an async load counts): the blocks they
        # lack to finish are kept free when admitting an async load, so a
        # load can never take what a prefill in progress relies on.
        self.inflight_prefills: set[Request] = set()
        self._finish_extra = 1 + spec_tokens + lookahead if spec_tokens else 0
        # An async load also leaves room for one draft step of its own.
        self._draft_step_blocks = -(-self._finish_extra // kv.block_size)
        # Finished requests whose blocks the connector keeps until it has sent them.
        self.sending: dict[str, Request] = {}
        # Failed loads being recomputed since the last step, for the decision trace.
        self.failure_notes: dict[str, str] = {}

    # ---- admission -----------------------------------------------------------

    def ready(self, req: Request) -> bool:
        """False while the request's load is in progress; once done, make it admissible."""
        if req.status is not _REMOTE:
            return True
        rid = req.request_id
        if rid not in self.finished_recving:
            return False
        self.finished_recving.discard(rid)
        if rid in self.failed_recving:
            self.failed_recving.discard(rid)
            self.failure_notes[rid] = f"async load failed; recomputing from token {req.num_computed_tokens}"
            if req.num_computed_tokens:
                self.kv.cache_blocks(req, req.num_computed_tokens)
            else:
                # Nothing valid arrived: give the blocks back; a new lookup
                # (local hit, or another load) decides what to compute.
                self.kv.free(req)
        else:
            # Loaded blocks enter the prefix cache only now that they hold KV.
            self.kv.cache_blocks(req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            # A whole-prompt load: the last token is computed again for its logits.
            req.num_computed_tokens -= 1
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return True

    def lookup(self, req: Request, num_local_hit: int) -> tuple[int | None, bool]:
        """Tokens the connector can load beyond the local hit, and whether asynchronously."""
        ext, load_async = self.connector.get_num_new_matched_tokens(req, num_local_hit)
        if req.skip_prefix_cache:
            return 0, False
        return ext, load_async

    def allocate(
        self,
        req: Request,
        n: int,
        hit_blocks: list[KVBlock],
        ext: int,
        load_async: bool,
        lookahead: int,
        reserve_full: bool,
        watermark: int,
    ) -> list[KVBlock] | None:
        """The admission's allocation: blocks for the hit, the load and this step's tokens."""
        kv = self.kv
        if kv.num_held_blocks(req.request_id):
            # Loaded earlier (a one-token prompt's whole-prompt load leaves
            # nothing computed, yet its block stays).
            return kv.allocate_held(req, ext + n, lookahead, reserve_full, watermark)
        if not load_async:
            return kv.allocate_new(req, ext + n, hit_blocks, lookahead, reserve_full, watermark)
        # An async load holds its blocks for the whole transfer and cannot
        # be preempted meanwhile; its lookahead slots come at admission.
        held_for_others = self._draft_step_blocks + sum(
            kv.num_blocks_to_finish(r, self._finish_extra) for r in self.inflight_prefills
        )
        return kv.allocate_new(
            req,
            ext,
            hit_blocks,
            0,
            reserve_full,
            watermark,
            held_for_others=held_for_others,
            delay_caching=True,
        )

    def allocated(self, req: Request, ext: int) -> None:
        """Tell the connector what was allocated (a load to start when ``ext`` > 0)."""
        self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), ext)

    def start_load(self, req: Request, num_computed: int) -> None:
        """The request waits for its async load, its loaded tokens counted as computed."""
        req.status = _REMOTE
        req.num_computed_tokens = num_computed
        self.inflight_prefills.add(req)

    @staticmethod
    def holds_blocks(req: Request) -> bool:
        """Whether a waiting request holds KV blocks (it then queues in ``holding``)."""
        return req.num_computed_tokens > 0 or req.status is _REMOTE

    # ---- after schedule() ----------------------------------------------------

    def after_schedule(self, out: SchedulerOutput) -> None:
        """Hand the connector's metadata out; track prefills and the step's fence."""
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if self.failure_notes:
            self.failure_notes = {}
        inflight = self.inflight_prefills
        for req in out.scheduled:
            if not req.is_prefill_chunk:
                inflight.discard(req)
        if self.defer_frees and out.scheduled:
            self.sched_seq += 1
            seq = self.sched_seq
            last = self.last_sched_seq
            for req in out.scheduled:
                last[req] = seq

    def can_preempt(self, victim: Request) -> bool:
        """Whether preempting ``victim`` would free blocks now."""
        if self.connector.has_pending_block_frees():
            return False
        return self._can_free(victim)

    def _can_free(self, req: Request) -> bool:
        return not self.defer_frees or self.last_sched_seq.get(req, 0) <= self.processed_seq

    def free(self, req: Request) -> None:
        """Free a request's blocks now, or once the steps that may still write them are applied."""
        if self._can_free(req):
            self.kv.free(req)
        else:
            blocks = self.kv.detach(req)
            if blocks:
                self.deferred_frees.append((self.sched_seq, blocks))
        if self.defer_frees and req.status.finished:
            self.last_sched_seq.pop(req, None)

    def forget(self, req: Request) -> None:
        """A request left the scheduler or the running queue: no prefill in progress."""
        self.inflight_prefills.discard(req)

    # ---- update_from_output() ------------------------------------------------

    def begin_update(
        self, out: SchedulerOutput, result: KVConnectorOutput | None, running: list[Request]
    ) -> set[str]:
        """Apply a step's load failures; returns the ids whose output must be skipped.

        Under ``fail`` those requests end with an error (``end_update``); under
        ``recompute`` a failed async load restarts at its first bad block once
        its transfer ends, and a failed sync load's request recomputes now.
        """
        if self.defer_frees and out.total_num_scheduled_tokens:
            self.processed_seq += 1
            self._drain_deferred_frees()
        if not result:
            return set()
        self.connector.update_connector_output(result)
        failed: set[str] = set()
        if result.failed_recving:
            failed |= self._failed_recving(result.failed_recving)
        if result.invalid_block_ids:
            failed |= self._invalid_blocks(set(result.invalid_block_ids), out, running)
        return failed

    def _drain_deferred_frees(self) -> None:
        deferred = self.deferred_frees
        while deferred and deferred[0][0] <= self.processed_seq:
            self.kv.release(deferred.popleft()[1])

    def _failed_recving(self, ids: Collection[str]) -> set[str]:
        affected: set[str] = set()
        for req in self.holding:
            rid = req.request_id
            if req.status is _REMOTE and rid in ids:
                affected.add(rid)
                if self.recompute_failures:
                    req.num_computed_tokens = 0
                    self.failed_recving.add(rid)
        return set() if self.recompute_failures else affected

    def _invalid_blocks(self, invalid: set[int], out: SchedulerOutput, running: list[Request]) -> set[str]:
        num_scheduled = out.num_scheduled_tokens_by_id()
        loading = [r for r in self.holding if r.status is _REMOTE]
        async_ids, _ = self._truncate_at_invalid(loading, invalid, num_scheduled, None)
        evict: set[int] | None = None if self.recompute_failures else set()
        sync_ids, evict = self._truncate_at_invalid(running, invalid, num_scheduled, evict)
        if evict:
            # Under ``fail`` nobody recomputes these blocks: drop them from the cache.
            self.kv.evict_block_ids(evict)
        if not self.recompute_failures:
            return async_ids | sync_ids
        self.failed_recving |= async_ids
        for req in running:
            if req.request_id in sync_ids:
                self.failure_notes[req.request_id] = (
                    f"blocks failed to load; recomputing from token {req.num_computed_tokens}"
                )
        return sync_ids

    def _truncate_at_invalid(
        self, reqs: list[Request], invalid: set[int], num_scheduled: dict[str, int], evict: set[int] | None
    ) -> tuple[set[str], set[int] | None]:
        """Cut each request's computed tokens back to its first invalid block.

        A bad block shared by several requests is recomputed by the first of
        them; the others keep it as computed and only fall back to what they
        had computed before this step.
        """
        bs = self.kv.block_size
        affected: set[str] = set()
        marked: set[int] = set()
        for req in reqs:
            rid = req.request_id
            block_ids = self.kv.get_block_ids(rid)
            before = req.num_computed_tokens - num_scheduled.get(rid, 0)
            hit = truncated = False
            for idx, block_id in enumerate(block_ids[: -(-before // bs)]):
                if block_id not in invalid:
                    continue
                hit = True
                if block_id in marked:
                    continue
                marked.add(block_id)
                if truncated:
                    continue
                truncated = True
                req.num_computed_tokens = idx * bs
                if evict is not None:
                    evict.update(block_ids[idx:])
            if hit:
                if not truncated:
                    req.num_computed_tokens = before
                affected.add(rid)
        return affected, evict

    def finished_with_delay(self, req: Request, delay_free: bool = False) -> None:
        """A request finished: the connector may keep its blocks until they are sent."""
        self.inflight_prefills.discard(req)
        delay, _ = self.connector.request_finished(req, self.kv.get_block_ids(req.request_id))
        if delay or delay_free:
            self.sending[req.request_id] = req
        else:
            self.free(req)

    def end_update(self, result: KVConnectorOutput | None) -> None:
        """Transfers that ended in this step: loads become admissible, sent blocks are freed."""
        if not result:
            return
        # Sorted: the events come as sets, and the order of frees decides
        # which blocks are reused first; a fixed one keeps replays repeatable.
        for rid in sorted(result.finished_recving or ()):
            req = self.sending.get(rid)
            if req is not None:
                # It ended (error or abort) while loading; its blocks can go now.
                del self.sending[rid]
                self.free(req)
            else:
                self.finished_recving.add(rid)
        for rid in sorted(result.finished_sending or ()):
            req = self.sending.pop(rid, None)
            if req is not None:
                self.free(req)

    def abort_load(self, req: Request) -> bool:
        """A loading request ends: True when its blocks must wait for the transfer to end."""
        rid = req.request_id
        done = rid in self.finished_recving
        self.finished_recving.discard(rid)
        self.failed_recving.discard(rid)
        return not done

    def trace_events(self, trace: StepTrace) -> None:
        """Name this step's recomputed load failures and the requests holding blocks to send."""
        for rid, note in self.failure_notes.items():
            trace.add(rid, Reason.KV_LOAD_FAILED, detail=note)
        for rid in self.sending:
            trace.add(rid, Reason.SENDING, detail=f"{self.kv.num_held_blocks(rid)} blocks held")

    def detached_tables(self) -> list[list[KVBlock]]:
        """Blocks whose free is deferred (for the invariant checks)."""
        return [blocks for _, blocks in self.deferred_frees]
