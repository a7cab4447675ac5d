"""Property tests for async scheduling: random workloads run through the engine's 2-deep step queue.

A fake executor keeps its own copy of every request's tokens (with async scheduling a decode's input
token is usually not in ``Request.token_ids`` yet when its step is planned) and settles each step's
outcome right after ``schedule()``, as a model runner queued in schedule order would: it writes a
shadow KV cache with the identity of each position's token prefix, checks that every chunk reads only
its own prefix, and samples from a small vocabulary so that EOS and stop tokens occur. The scheduler
learns each step's output one step later. Drafts are out of scope (``num_speculative_tokens=0``).

Checked: the debug invariants, budget and sequence limits; the shadow KV (prefix hits, preemption,
aborts and stops with steps in flight, blocks reused by the next step); chunk positions continuing the
executor's own progress; every request's tokens against a stop-rule oracle over what was sampled; the
async counters against the steps in flight; no decode wasted past a length cap; a clean drain; and
determinism. The workloads come from the sync property test's strategy (``tests`` is on pytest's
pythonpath).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass

from hypothesis import event, example, given
from hypothesis import strategies as st

from core.test_scheduler_properties import (
    TIED_VICTIMS,
    WITHDRAWN_CHUNK_HIT,
    ReqSpec,
    Workload,
    _settings,
    workloads,
)
from llmsched.core import (
    ModelRunnerOutput,
    Reason,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

_RUNNING = RequestStatus.RUNNING


def oracle(spec: ReqSpec, seq: list[int], max_model_len: int) -> tuple[list[int], RequestStatus]:
    """The tokens a request keeps out of everything sampled for it, and why it stops (RUNNING: not yet)."""
    stop_ids = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(spec.eos))
    plen = len(spec.prompt)
    stop_length = min(plen + spec.max_tokens, max_model_len)
    for k in range(plen, len(seq)):
        if seq[k] in stop_ids and k + 1 - plen > spec.min_tokens:
            return seq[: k + 1], RequestStatus.FINISHED_STOPPED
        if k + 1 >= stop_length:
            return seq[: k + 1], RequestStatus.FINISHED_LENGTH_CAPPED
    return list(seq), _RUNNING


def counters(r: Request) -> tuple[int, int, int]:
    """A request's async counters: (in flight, output placeholders, stale output)."""
    return r.num_in_flight_tokens, r.num_output_placeholders, r.num_stale_output_tokens


@dataclass
class Track:
    """One request as the test and its executor know it, apart from the scheduler's state."""

    spec: ReqSpec
    req: Request
    # The executor's own sequence: the prompt and every token it sampled (kept across preemptions).
    seq: list[int]
    # Interned prefix identities of ``seq``, extended lazily: the content of each position's KV.
    codes: list[int]
    # Positions whose KV the executor computed for its current residency (-1: not resident).
    end: int = -1
    aborted_tokens: list[int] | None = None
    preempted: bool = False
    # (in flight, placeholders, stale) at the moment it finished or was aborted; None while live.
    at_finish: tuple[int, int, int] | None = None


class AsyncHarness:
    """Drives one workload: schedule, execute at once, update one step later; checks from outside."""

    def __init__(self, wl: Workload, interval: int = 1, debug: bool = True, depth: int = 2) -> None:
        config = {**wl.config, "num_speculative_tokens": 0, "prefill_schedule_interval": interval}
        self.wl = wl
        # Steps in flight at most: the engine's batch queue holds 2; deeper ones test the set-aside path.
        self.depth = depth
        self.cfg = SchedulerConfig(**config, async_scheduling=True, debug=debug)
        self.sched = Scheduler(self.cfg)
        self.sched.enable_trace(depth > 2)
        self.rng = random.Random(wl.seed)
        self.queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.tracks: dict[str, Track] = {}
        self.trie: dict[tuple[int, int, int], int] = {}
        # The KV slot array: the prefix identity each slot was last written with (-1: never).
        self.shadow = [-1] * (self.cfg.num_gpu_blocks * self.cfg.block_size)
        self.reported: Counter[str] = Counter()
        self.log: list[object] = []
        self.seen: set[str] = set()

    # -- the engine loop --------------------------------------------------------------

    def run(self) -> list[object]:
        """Run to completion (within a generous bound of turns); returns the decision log."""
        wl, s = self.wl, self.sched
        arrivals: dict[int, list[ReqSpec]] = {}
        for spec in wl.requests:
            arrivals.setdefault(spec.arrival_step, []).append(spec)
        aborts: dict[int, list[tuple[str, ...]]] = {}
        for turn, ids in wl.aborts:
            aborts.setdefault(turn, []).append(ids)
        last = max(spec.arrival_step for spec in wl.requests)
        bound = last + 100 + 8 * sum(len(spec.prompt) + spec.max_tokens for spec in wl.requests)
        turn = 0
        while turn <= last or s.has_requests() or self.queue:
            assert turn < bound, f"no termination after {turn} turns"
            for spec in arrivals.get(turn, ()):
                self._add(spec)
            for ids in aborts.get(turn, ()):
                self._abort(ids)
            if s.has_requests():
                assert len(self.queue) < self.depth, "a step planned with a full queue"
                self._schedule()
            if self.queue and (len(self.queue) == self.depth or not s.has_requests()):
                self._update()
            turn += 1
        self._check_end()
        return self.log

    def report(self) -> None:
        """Tell hypothesis what the run exercised (see --hypothesis-show-statistics)."""
        for what in sorted(self.seen):
            event(what)

    def _add(self, spec: ReqSpec) -> None:
        """Add a request (valid by construction, so never rejected)."""
        req = spec.make()
        self.sched.add_request(req)
        self.tracks[spec.rid] = Track(spec, req, list(spec.prompt), [])

    def _abort(self, ids: tuple[str, ...]) -> None:
        """Abort ids: exactly the live ones finish as aborted, and their blocks are freed at once."""
        live = {rid for rid in ids if rid in self.tracks and self.tracks[rid].at_finish is None}
        found = self.sched.finish_requests(ids)
        assert {r.request_id for r in found} == live and len(found) == len(live)
        for r in found:
            t = self.tracks[r.request_id]
            assert r.status is RequestStatus.FINISHED_ABORTED
            assert self.sched.kv.get_block_ids(r.request_id) == []
            t.aborted_tokens = list(r.token_ids)
            self._finish(t)
            if r.num_in_flight_tokens:
                self.seen.add("aborted with a step in flight")

    def _finish(self, t: Track) -> None:
        """Record a request's end (the executor drops its state) and the async counters it left."""
        r = t.req
        t.at_finish = counters(r)
        t.end = -1

    # -- schedule(), and the executor that settles the step at once ----------------------

    def _schedule(self) -> None:
        """Plan a step, check the batch, settle its outcome and queue it."""
        s, cfg = self.sched, self.cfg
        out = s.schedule()
        ids = [r.request_id for r in out.scheduled]
        assert len(set(ids)) == len(ids), "a request scheduled twice in one step"
        assert all(n > 0 for n in out.num_scheduled_tokens)
        assert sum(out.num_scheduled_tokens) == out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(ids) <= len(s.running) <= cfg.max_num_seqs
        assert not set(ids) & {r.request_id for r in out.preempted}
        for rid in out.finished_req_ids:
            assert self.tracks[rid].at_finish is not None, f"{rid} reported finished while live"
            self.reported[rid] += 1
            assert self.reported[rid] == 1, f"{rid} reported finished twice"
        for r in out.preempted:
            t = self.tracks[r.request_id]
            assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0
            assert r.num_output_placeholders == 0 and r.num_stale_output_tokens == r.num_in_flight_tokens
            assert s.kv.get_block_ids(r.request_id) == []
            t.end, t.preempted = -1, True
            if r.num_in_flight_tokens:
                self.seen.add("preempted with a step in flight")
        if out.trace is not None and any(e.reason is Reason.OUTPUT_IN_FLIGHT for e in out.trace.entries):
            self.seen.add("set aside while its stale output is in flight")
        result = self._execute(out)
        self.queue.append((out, result))
        preempted = [r.request_id for r in out.preempted]
        self.log.append((out.step, list(zip(ids, out.num_scheduled_tokens)), preempted, out.finished_req_ids))

    def _codes(self, t: Track) -> list[int]:
        """Prefix identities for every token of the executor's sequence (a trie keyed by adapter)."""
        codes, seq, lora = t.codes, t.seq, t.req.lora_id
        while len(codes) < len(seq):
            key = (codes[-1] if codes else -1, lora, seq[len(codes)])
            codes.append(self.trie.setdefault(key, len(self.trie)))
        return codes

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Write the batch's KV, check what each chunk attends to, sample for the rows that complete."""
        kv, bs, shadow = self.sched.kv, self.cfg.block_size, self.shadow
        hits = {r.request_id: h for r, h in zip(out.admitted, out.admitted_num_cached_tokens)}
        rows = []
        for r, n in zip(out.scheduled, out.num_scheduled_tokens):
            t, rid, end = self.tracks[r.request_id], r.request_id, r.num_computed_tokens
            start = end - n
            if rid in hits:
                # (Re)admitted: the executor reads the request's tokens now, so all must be applied.
                assert t.end == -1 and start == hits[rid]
                assert r.num_stale_output_tokens == 0 and r.num_in_flight_tokens == n, "output in flight"
                assert r.token_ids == t.seq, f"{rid}: tokens {r.token_ids} at admission, sampled {t.seq}"
                first = out.recompute_from.get(rid, start)
                if first < start:
                    self.seen.add("hit on a withdrawn chunk's blocks")
                if start:
                    self.seen.add("prefix hit on resume" if t.preempted else "prefix hit")
            else:
                assert start == t.end, f"{rid}: chunk starts at {start}, its KV is computed up to {t.end}"
                first = start
            assert end <= len(t.seq), f"{rid}: computes position {end - 1} of {len(t.seq)} known tokens"
            assert end < self.cfg.max_model_len
            sampling = end == len(t.seq)
            assert sampling is not r.is_prefill_chunk, f"{rid}: sampling row {sampling}, scheduler thinks not"
            table = kv.get_block_ids(rid)
            assert len(table) * bs >= end, f"{rid}: {len(table)} blocks for {end} positions"
            codes = self._codes(t)
            for p in range(first, end):
                shadow[table[p // bs] * bs + p % bs] = codes[p]
            t.end = end
            rows.append((t, start, table, sampling))
        sampled: list[list[int]] = []
        for t, start, table, sampling in rows:
            got = [shadow[table[p // bs] * bs + p % bs] for p in range(start)]
            assert got == t.codes[:start], f"{t.spec.rid} reads KV that is not its own prefix"
            if sampling:
                t.seq.append(self.rng.randrange(self.wl.vocab))
            sampled.append([t.seq[-1]] if sampling else [])
        return ModelRunnerOutput(sampled)

    # -- update_from_output(), one step later ------------------------------------------

    def _update(self) -> None:
        """Apply the oldest step; tokens land exactly once, in order, and finished requests are released."""
        s = self.sched
        out, result = self.queue.popleft()
        done_before = {r.request_id for r in out.scheduled if self.tracks[r.request_id].at_finish is not None}
        before = {r.request_id: (len(r.token_ids), r.status) for r in out.scheduled}
        res = s.update_from_output(out, result)
        expect = [
            r
            for r, toks in zip(out.scheduled, result.sampled_token_ids)
            if toks and r.request_id not in done_before
        ]
        assert res.updated == expect, "updated requests differ from those whose tokens arrived"
        assert set(res.finished) <= set(res.updated)
        for r in res.updated:
            t = self.tracks[r.request_id]
            assert len(r.token_ids) == before[r.request_id][0] + 1 == r.num_tokens
            assert r.token_ids == t.seq[: len(r.token_ids)], f"{r.request_id}: not the tokens sampled"
        for r in res.finished:
            t = self.tracks[r.request_id]
            assert r.is_finished and r.request_id not in s.requests and s.kv.get_block_ids(r.request_id) == []
            self._finish(t)
            if before[r.request_id][1] is not _RUNNING:
                self.seen.add("stale output finished a waiting request")
            elif r.num_in_flight_tokens:
                self.seen.add("finished with a step in flight")
        for rid in done_before:
            assert len(self.tracks[rid].req.token_ids) == before[rid][0], f"{rid}: token after its end"
        self._check_live()

    def _check_live(self) -> None:
        """Each live request's async counters agree with the steps in flight and the executor's view."""
        in_flight: Counter[str] = Counter()
        for out, _ in self.queue:
            in_flight.update(out.num_scheduled_tokens_by_id())
        for rid, r in self.sched.requests.items():
            t = self.tracks[rid]
            assert r.num_in_flight_tokens == in_flight[rid], f"{rid}: in flight {r.num_in_flight_tokens}"
            if r.status is _RUNNING:
                pending = len(t.seq) - r.num_tokens
                assert r.num_output_placeholders == pending >= 0, f"{rid}: {pending} pending"
                assert r.num_stale_output_tokens == 0 and r.num_computed_tokens == t.end
            else:
                assert r.num_output_placeholders == 0 and r.num_computed_tokens == 0 and t.end == -1
                assert r.num_stale_output_tokens == r.num_in_flight_tokens

    # -- the end -----------------------------------------------------------------------

    def _check_end(self) -> None:
        """Everything drained and freed; each request kept exactly the tokens the stop rules allow."""
        s, kv, mml = self.sched, self.sched.kv, self.cfg.max_model_len
        assert not s.has_requests() and s.requests == {} and s.running == [] and len(s.waiting) == 0
        assert kv.usage == 0.0 and kv.num_free_blocks == self.cfg.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
        kv.check_invariants()
        assert sorted(self.reported) == sorted(self.tracks) and set(self.reported.values()) <= {1}
        for rid, t in self.tracks.items():
            r, plen = t.req, len(t.spec.prompt)
            assert t.at_finish is not None and r.is_finished
            # Settled, or frozen as they were when it ended with a step in flight: as in vLLM, the
            # output of a step of a request already finished is dropped unread, counters included.
            assert counters(r) in {(0, 0, 0), t.at_finish}, (
                f"{rid}: counters {counters(r)} moved after its end"
            )
            if t.aborted_tokens is not None:
                assert r.status is RequestStatus.FINISHED_ABORTED and r.token_ids == t.aborted_tokens
                assert t.seq[: len(r.token_ids)] == r.token_ids
                assert oracle(t.spec, r.token_ids, mml)[1] is _RUNNING, f"{rid}: aborted after a stop"
                continue
            kept, status = oracle(t.spec, t.seq, mml)
            assert r.token_ids == kept, f"{rid}: kept {r.output_token_ids}, sampled {t.seq[plen:]}"
            assert r.status is status, f"{rid}: {r.status.name}, the oracle says {status.name}"
            # With the engine's 2-deep queue a request capped by length (max_tokens, or max_model_len) was
            # sampled exactly its output, preempted or not: the max_tokens skip and the position cap leave
            # no wasted decode. One stopped by a stop token was sampled at most one more token (the step
            # planned before the stop was known). The skip rule is made for that depth: each step deeper
            # may cost one more.
            wasted = len(t.seq) - len(kept)
            most = self.depth - 2 if status is RequestStatus.FINISHED_LENGTH_CAPPED else self.depth - 1
            assert wasted <= most, f"{rid}: {wasted} tokens sampled past its {status.name}"
            if wasted:
                self.seen.add("a token sampled past a stop")
            if t.preempted:
                self.seen.add(f"preempted, then {status.name.lower()}")


# ---- the properties ----------------------------------------------------------------


@_settings(150)
@given(wl=workloads(num_rejects=0), interval=st.sampled_from([1, 1, 1, 2, 3]))
def test_async_random_workloads_keep_kv_and_tokens_exact(wl: Workload, interval: int) -> None:
    """Any knob mix and request stream: KV reads stay within each request's prefix, tokens land exactly."""
    h = AsyncHarness(wl, interval)
    h.run()
    h.report()


@_settings(150)
@given(wl=workloads(pressure=True, num_rejects=0))
@example(wl=WITHDRAWN_CHUNK_HIT)
@example(wl=TIED_VICTIMS)
def test_async_preemption_under_cache_pressure(wl: Workload) -> None:
    """Preemption while steps are in flight (stale output, resumes, prefix hits) keeps KV and tokens exact."""
    h = AsyncHarness(wl)
    h.run()
    h.report()


@_settings(40)
@given(wl=st.one_of(workloads(num_rejects=0), workloads(pressure=True, num_rejects=0)))
def test_async_decisions_are_deterministic(wl: Workload) -> None:
    """Two runs of one workload (debug checks on, then off) make the same decisions and outputs."""
    first, h = AsyncHarness(wl), AsyncHarness(wl, debug=False)
    assert first.run() == h.run()
    ends = [[(t.req.status, t.req.token_ids) for t in x.tracks.values()] for x in (first, h)]
    assert ends[0] == ends[1]


@_settings(100)
@given(wl=workloads(pressure=True, num_rejects=0))
def test_async_deeper_queue_sets_requests_with_stale_output_aside(wl: Workload) -> None:
    """With three steps in flight a preempted request can be met with output in flight: it waits for it."""
    h = AsyncHarness(wl, depth=3)
    h.run()
    h.report()
