"""Property-based tests: random workloads drive the Scheduler to completion under outside checks."""

from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from llmsched.core import (
    ModelRunnerOutput,
    Reason,
    Request,
    RequestRejected,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepOutputs,
)

# ---- settings ----------------------------------------------------------------

# LLMSCHED_PROPERTY_SCALE multiplies every example count for a deeper local hunt;
# CI (or LLMSCHED_PROPERTY_DERANDOMIZE=1) runs a fixed, reproducible example set.
_SCALE = float(os.environ.get("LLMSCHED_PROPERTY_SCALE", "1"))
_DERANDOMIZE = bool(os.environ.get("CI")) or os.environ.get("LLMSCHED_PROPERTY_DERANDOMIZE", "0") != "0"


def _settings(max_examples: int) -> settings:
    """Shared hypothesis settings: no deadline (runs vary in length), reproducible failures."""
    return settings(
        max_examples=max(1, int(max_examples * _SCALE)),
        deadline=None,
        derandomize=_DERANDOMIZE,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


GHOST_IDS = ("ghost-0", "ghost-1")


def cdiv(a: int, b: int) -> int:
    """Ceiling division (an independent copy, so the test does not trust the code under test)."""
    return -(-a // b)


# ---- workloads ---------------------------------------------------------------


@dataclass(frozen=True)
class ReqSpec:
    """One request of a workload and the step before which it arrives."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    eos: tuple[int, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    priority: int
    arrival_step: int
    arrival_time: float
    lora_id: int
    cache_salt: str | None
    skip_prefix_cache: bool

    def make(self) -> Request:
        """A fresh Request for this spec."""
        params = SamplingParams(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )
        return Request(
            self.rid,
            self.prompt,
            params,
            eos_token_ids=self.eos,
            priority=self.priority,
            arrival_time=self.arrival_time,
            lora_id=self.lora_id,
            cache_salt=self.cache_salt,
            skip_prefix_cache=self.skip_prefix_cache,
        )


@dataclass(frozen=True)
class Workload:
    """A scheduler configuration plus everything that happens to it, step by step."""

    config: dict
    requests: tuple[ReqSpec, ...]
    # (step, ids): abort these ids just before that step's schedule().
    aborts: tuple[tuple[int, tuple[str, ...]], ...]
    # (step, kind): try to add an invalid request just before that step's schedule().
    rejects: tuple[tuple[int, str], ...]
    vocab: int
    seed: int

    def stop_length(self, spec: ReqSpec) -> int:
        """Tokens at which the request is length-capped."""
        return min(len(spec.prompt) + spec.max_tokens, self.config["max_model_len"])

    def blocks_needed(self, spec: ReqSpec) -> int:
        """KV blocks the request holds at most (its last sampled token is never computed)."""
        c = self.config
        slots = self.stop_length(spec) - 1 + c["num_speculative_tokens"] + c["num_lookahead_tokens"]
        return cdiv(min(slots, c["max_model_len"]), c["block_size"])

    @property
    def roomy(self) -> bool:
        """The cache holds every request at full length at once, watermark kept free."""
        c = self.config
        usable = c["num_gpu_blocks"] - 1
        watermark = int(c["watermark"] * c["num_gpu_blocks"])
        return usable - watermark >= sum(self.blocks_needed(s) for s in self.requests)


REJECT_KINDS = ("empty", "too_long", "too_big", "duplicate", "readd")


@st.composite
def workloads(
    draw: st.DrawFn, max_requests: int = 10, num_rejects: int = 2, pressure: bool = False
) -> Workload:
    """A random knob mix and a random request stream that the cache can always serve.

    ``pressure`` narrows the mix to priority scheduling with prefix caching and small blocks in
    a cache too small for everyone, with requests that run to their length, where later
    arrivals outrank earlier ones (victims are then withdrawn after being scheduled and
    resume with cache hits) or all tie on (priority, arrival_time).
    """
    bs = draw(st.sampled_from([1, 2, 4] if pressure else [1, 2, 4, 8, 16]))
    mml = draw(st.integers(2, 96))
    chunked = pressure or draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    if chunked:
        budget = draw(st.one_of(st.integers(max_num_seqs, 16), st.integers(max_num_seqs, 128)))
    else:
        budget = draw(st.integers(max(mml, max_num_seqs), mml + 32))
    spec_tokens = draw(st.one_of(st.just(0), st.integers(1, 4)))
    config = {
        "max_model_len": mml,
        "block_size": bs,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": draw(
            st.integers(1, min(mml, 8)) if pressure else st.one_of(st.just(0), st.integers(1, mml))
        ),
        "policy": "priority" if pressure else draw(st.sampled_from(["fcfs", "priority"])),
        "scheduler_reserve_full_isl": draw(st.booleans()),
        "watermark": draw(st.one_of(st.just(0.0), st.integers(1, 30).map(lambda x: x / 100))),
        "enable_prefix_caching": pressure or draw(st.sampled_from([True, True, False])),
        "prefix_caching_hash_algo": draw(st.sampled_from(["sha256", "blake2b"])),
        "max_loras": None if pressure else draw(st.one_of(st.none(), st.integers(1, 2))),
        "num_speculative_tokens": spec_tokens,
        "num_lookahead_tokens": draw(st.one_of(st.just(0), st.integers(1, 3))),
    }
    vocab = draw(st.integers(2, 24))
    # Later arrivals outrank earlier ones: priority victims then sit ahead in running order
    # and may already be scheduled in the step that preempts them.
    inverted = pressure or draw(st.booleans())
    # Or everyone ties on (priority, arrival_time), as a batch stamped with one clock reading,
    # admitted chunk by chunk into a cache that holds little more than the longest request.
    tied = pressure and draw(st.booleans())
    if tied:
        config["scheduler_reserve_full_isl"] = False
    token = st.integers(0, vocab - 1)
    bases = draw(st.lists(st.lists(token, min_size=mml, max_size=mml), min_size=1, max_size=3))
    n = draw(st.integers(1, max_requests))
    specs = []
    for k in range(n):
        plen = draw(st.integers(1, mml - 1))
        a, b = draw(st.sampled_from(bases)), draw(st.sampled_from(bases))
        shared = draw(st.integers(0, plen))
        off = draw(st.integers(0, mml - (plen - shared)))
        prompt = tuple(a[:shared] + b[off : off + plen - shared])
        # Under inverted priorities short outputs make room fast, so victims resume while
        # their freed blocks are still cached.
        max_tokens = draw(st.integers(1, 6 if pressure and not tied else 40))
        step = draw(st.one_of(st.just(0), st.integers(0, 30)))
        specs.append(
            ReqSpec(
                rid=f"r{k}",
                prompt=prompt,
                max_tokens=max_tokens,
                min_tokens=draw(st.one_of(st.just(0), st.integers(0, max_tokens))),
                # Under pressure requests run to their length: the longer, the more contention.
                eos=() if pressure else tuple(draw(st.lists(token, max_size=2))),
                stop_token_ids=() if pressure else tuple(draw(st.lists(token, max_size=2))),
                ignore_eos=draw(st.booleans()),
                priority=0 if tied else -step if inverted else draw(st.integers(-1, 2)),
                arrival_step=step,
                # Equal arrival times on purpose: they exercise the tie-breaks.
                arrival_time=0.0 if tied else float(step) + draw(st.sampled_from([0.0, 0.0, 0.5])),
                lora_id=0 if pressure else draw(st.sampled_from([0, 0, 1, 2, 3])),
                cache_salt=None if pressure else draw(st.sampled_from([None, None, None, "a", "b"])),
                skip_prefix_cache=False if pressure else draw(st.sampled_from([False, False, False, True])),
            )
        )
    partial = Workload(config, tuple(specs), (), (), vocab, 0)
    need = [partial.blocks_needed(s) for s in specs]
    if pressure:
        extra = draw(st.integers(0, 2 if tied else max(need) // 2))
    else:
        extra = draw(st.one_of(st.integers(0, 3), st.integers(0, sum(need) + 8)))
    config["num_gpu_blocks"] = 1 + max(need) + extra
    ids = st.sampled_from([s.rid for s in specs] + list(GHOST_IDS))
    aborts = draw(
        st.lists(
            st.tuples(st.integers(0, 80), st.lists(ids, min_size=1, max_size=3).map(tuple)),
            max_size=4,
        )
    )
    rejects = draw(
        st.lists(st.tuples(st.integers(0, 60), st.sampled_from(REJECT_KINDS)), max_size=num_rejects)
    )
    seed = draw(st.integers(0, 2**32 - 1))
    return Workload(config, tuple(specs), tuple(aborts), tuple(rejects), vocab, seed)


# ---- the harness ---------------------------------------------------------------


@dataclass
class Track:
    """What the test knows about one request, kept apart from the scheduler's state."""

    spec: ReqSpec
    req: Request
    # Drafts the executor proposed that the scheduler should hold for the next step.
    drafts: list[int] = field(default_factory=list)
    # Prefix ids of the request's tokens (a trie over (lora, tokens)): KV content identity.
    codes: list[int] = field(default_factory=list)
    aborted: bool = False
    # Prefix-cache hit at the first admission (-1 before it).
    first_hit: int = -1


class Harness:
    """Drives one workload through schedule / fake execute / update, checking everything from outside."""

    def __init__(self, wl: Workload, *, debug: bool = False, trace: bool = False) -> None:
        self.wl = wl
        self.cfg = SchedulerConfig(**wl.config, debug=debug)
        self.sched = Scheduler(self.cfg)
        if trace:
            self.sched.enable_trace()
        # Count the built-in checks, to know debug mode really runs them.
        self.num_debug_checks = 0
        kv_check = self.sched.kv.check_invariants

        def counted_check() -> None:
            self.num_debug_checks += 1
            kv_check()

        self.sched.kv.check_invariants = counted_check  # type: ignore[method-assign]
        self.trace = trace
        self.bs = self.cfg.block_size
        self.mml = self.cfg.max_model_len
        self.usable = self.cfg.num_gpu_blocks - 1
        self.rng = random.Random(wl.seed)
        self.tracks: dict[str, Track] = {}
        self.live: set[str] = set()
        self.roomy = wl.roomy
        self.unreported: list[str] = []
        # Finished and aborted ids, in the order they finished.
        self.finished_order: list[str] = []
        self.reported: Counter[str] = Counter()
        self.log: list[object] = []
        self.trie: dict[tuple[int, int], int] = {}
        # Shadow KV cache: the prefix id each slot was last written with (-1 never).
        self.shadow = [-1] * (self.cfg.num_gpu_blocks * self.bs)
        # What the run exercised, reported as hypothesis events (--hypothesis-show-statistics).
        self.seen: set[str] = set()
        # Admission lookups as PrefixCacheStats counts them: requests, queries, hits; then preempted.
        self.lookups = [0] * 6

    # -- helpers ------------------------------------------------------------------

    def _code(self, parent: int, lora: int, tok: int) -> int:
        """Interned id of the prefix ``parent`` extended by ``tok`` under adapter ``lora``."""
        key = (parent, lora * 1_000_003 + tok)
        c = self.trie.get(key)
        if c is None:
            c = self.trie[key] = len(self.trie)
        return c

    def _codes(self, t: Track) -> list[int]:
        """Prefix ids for every real token of the request (extended lazily)."""
        codes, toks, lora = t.codes, t.req.token_ids, t.req.lora_id
        while len(codes) < len(toks):
            codes.append(self._code(codes[-1] if codes else -1, lora, toks[len(codes)]))
        return codes

    def _snapshot(self) -> tuple:
        """Everything observable about the scheduler and its cache, for before/after comparisons."""
        s, kv = self.sched, self.sched.kv
        return (
            [r.request_id for r in s.running],
            [r.request_id for r in s.waiting],
            sorted(s.requests),
            {
                rid: (r.status, r.num_computed_tokens, tuple(r.token_ids), tuple(kv.get_block_ids(rid)))
                for rid, r in s.requests.items()
            },
            kv.pool.free_queue.block_ids(),
            kv.pool.num_cached_blocks(),
            [(b.ref_cnt, b.block_hash) for b in kv.pool.blocks],
            s.has_requests(),
        )

    # -- the run ------------------------------------------------------------------

    def run(self) -> list[object]:
        """Run to completion (asserting termination within a generous bound); returns the decision log."""
        wl, s = self.wl, self.sched
        arrivals: dict[int, list[ReqSpec]] = {}
        for spec in wl.requests:
            arrivals.setdefault(spec.arrival_step, []).append(spec)
        aborts: dict[int, list[tuple[str, ...]]] = {}
        for step, ids in wl.aborts:
            aborts.setdefault(step, []).append(ids)
        rejects: dict[int, list[str]] = {}
        for step, kind in wl.rejects:
            rejects.setdefault(step, []).append(kind)
        last_arrival = max(spec.arrival_step for spec in wl.requests)
        work = sum(len(spec.prompt) + spec.max_tokens for spec in wl.requests)
        bound = last_arrival + 100 + 8 * work
        step = 0
        while step <= last_arrival or s.has_requests():
            assert step < bound, f"no termination after {step} steps ({work} tokens of work)"
            for spec in arrivals.get(step, ()):
                self._add(spec)
            for kind in rejects.get(step, ()):
                self._try_reject(kind)
            for ids in aborts.get(step, ()):
                self._abort(ids)
            self._step(step)
            step += 1
        self._check_end()
        # Debug mode checks the KV invariants at least once a step; otherwise never.
        if self.cfg.debug:
            assert self.num_debug_checks >= step, f"{self.num_debug_checks} checks in {step} steps"
        else:
            assert self.num_debug_checks == 0
        return self.log

    def report(self) -> None:
        """Tell hypothesis what the run exercised (shown by --hypothesis-show-statistics)."""
        for what in sorted(self.seen):
            event(what)

    def _add(self, spec: ReqSpec) -> None:
        """Add a valid request, which must be accepted."""
        req = spec.make()
        self.sched.add_request(req)  # valid by construction: must not raise
        assert req.stop_length == self.wl.stop_length(spec)
        self.tracks[spec.rid] = Track(spec, req)
        self.live.add(spec.rid)

    def _try_reject(self, kind: str) -> None:
        """An invalid add_request raises RequestRejected and changes nothing at all."""
        s, cfg = self.sched, self.cfg
        obj: Request | None = None
        if kind == "readd":
            done = [t.req for t in self.tracks.values() if t.req.is_finished]
            live = [self.tracks[rid].req for rid in sorted(self.live)]
            obj = (done or live or [None])[0]
        elif kind == "duplicate" and self.live:
            obj = self.tracks[min(self.live)].spec.make()
        elif kind == "too_big":
            # A prompt that fits max_model_len but could never finish in the whole cache.
            plen, mt = self.mml - 1, self.mml
            # Drafts count from a block's worth on (with the lookahead).
            drafts = cfg.num_speculative_tokens
            if drafts + cfg.num_lookahead_tokens < self.bs:
                drafts = 0
            slots = min(plen + mt, self.mml) - 1 + drafts + cfg.num_lookahead_tokens
            if cdiv(min(slots, self.mml), self.bs) > self.usable:
                obj = Request("rejected-big", [1] * plen, SamplingParams(max_tokens=mt))
        if obj is None and kind == "empty":
            obj = Request("rejected-empty", [])
        if obj is None:
            obj = Request("rejected-long", [1] * (self.mml + (kind == "too_long")))
        before = self._snapshot()
        status, stop_length, computed = obj.status, obj.stop_length, obj.num_computed_tokens
        raised = False
        try:
            s.add_request(obj)
        except RequestRejected:
            raised = True
        assert raised, f"{kind}: {obj!r} was accepted"
        self.seen.add(f"rejected ({kind})")
        assert self._snapshot() == before, f"rejecting {obj!r} changed the scheduler's state"
        assert (obj.status, obj.stop_length, obj.num_computed_tokens) == (status, stop_length, computed)

    def _abort(self, ids: tuple[str, ...]) -> None:
        """Abort ids: live ones finish as aborted, unknown and finished ones change nothing."""
        s = self.sched
        expected = []
        for rid in ids:
            if rid in self.live and self.tracks[rid].req not in expected:
                expected.append(self.tracks[rid].req)
        others = {
            rid: (r.status, r.num_computed_tokens, tuple(s.kv.get_block_ids(rid)))
            for rid, r in s.requests.items()
            if r not in expected
        }
        running_rest = [r for r in s.running if r not in expected]
        waiting_rest = [r for r in s.waiting if r not in expected]
        for rid in ids:
            r = s.requests.get(rid)
            if r is not None:
                self.seen.add(f"abort {r.status.name.lower()}")
            else:
                self.seen.add("abort finished" if rid in self.tracks else "abort unknown")
        got = s.finish_requests(list(ids))
        assert [r.request_id for r in got] == [r.request_id for r in expected]
        assert all(a is b for a, b in zip(got, expected))
        for r in got:
            assert r.status is RequestStatus.FINISHED_ABORTED
            assert s.kv.get_block_ids(r.request_id) == []
            t = self.tracks[r.request_id]
            t.aborted = True
            self.live.discard(r.request_id)
            self.unreported.append(r.request_id)
            self.finished_order.append(r.request_id)
        assert s.running == running_rest, "abort reordered or dropped other running requests"
        assert list(s.waiting) == waiting_rest, "abort reordered or dropped other waiting requests"
        assert {
            rid: (r.status, r.num_computed_tokens, tuple(s.kv.get_block_ids(rid)))
            for rid, r in s.requests.items()
        } == others
        self.log.append(("abort", ids, [r.request_id for r in got]))
        self._check_state(after_update=True)

    def _step(self, step: int) -> None:
        """One schedule / execute / update cycle with every check around it."""
        s, cfg = self.sched, self.cfg
        running_before = list(s.running)
        waiting_before = list(s.waiting)
        computed_before = {r.request_id: r.num_computed_tokens for r in running_before}
        tables_before = {r.request_id: s.kv.get_block_ids(r.request_id) for r in running_before}
        many = len(running_before) + len(waiting_before) > 1
        threshold = cfg.long_prefill_token_threshold if many else 0

        out = s.schedule()
        self._check_schedule(
            step, out, running_before, waiting_before, computed_before, tables_before, threshold
        )
        self._check_state(after_update=False)
        result = self._execute(out)
        before_update = {r.request_id: (list(r.token_ids), r.num_computed_tokens) for r in out.scheduled}
        running = list(s.running)
        res = s.update_from_output(out, result)
        self._check_update(out, result, res, before_update, running)
        self._check_state(after_update=True)
        self.log.append(
            (
                out.step,
                [(r.request_id, n) for r, n in zip(out.scheduled, out.num_scheduled_tokens)],
                out.total_num_scheduled_tokens,
                [r.request_id for r in out.admitted],
                out.admitted_block_ids,
                out.admitted_num_cached_tokens,
                sorted(out.new_block_ids.items()),
                sorted(out.spec_decode_tokens.items()),
                [r.request_id for r in out.preempted],
                out.finished_req_ids,
                [r.request_id for r in res.updated],
                [r.request_id for r in res.finished],
                [list(x) for x in result.sampled_token_ids],
            )
        )

    # -- checks after schedule() ---------------------------------------------------

    def _check_schedule(
        self,
        step: int,
        out: SchedulerOutput,
        running_before: list[Request],
        waiting_before: list[Request],
        computed_before: dict[str, int],
        tables_before: dict[str, list[int]],
        threshold: int,
    ) -> None:
        """The batch obeys the contract: budget, order, preemption, admission, KV slots, trace."""
        s, cfg, bs, kv = self.sched, self.cfg, self.bs, self.sched.kv
        budget = cfg.max_num_batched_tokens
        assert out.step == step
        # Token accounting.
        assert len(out.scheduled) == len(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens <= budget
        assert all(n > 0 for n in out.num_scheduled_tokens), out.num_scheduled_tokens
        ids = [r.request_id for r in out.scheduled]
        assert len(set(ids)) == len(ids), f"scheduled twice: {ids}"
        assert len(s.running) <= cfg.max_num_seqs
        # Finished and aborted requests are reported exactly once, in order.
        assert out.finished_req_ids == self.unreported, (out.finished_req_ids, self.unreported)
        self.reported.update(out.finished_req_ids)
        self.unreported = []
        if threshold:
            assert max(out.num_scheduled_tokens, default=0) <= threshold, out.num_scheduled_tokens

        # Preemption: never with admissions; victims chosen by the policy; state reset.
        preempted = out.preempted
        if preempted:
            self.seen.add("preemption")
            assert not out.admitted, "admitted requests in a step that preempted"
            assert not self.roomy, "preempted although the cache holds every request at once"
        rest = list(running_before)
        for victim in preempted:
            assert victim in rest, f"victim {victim.request_id} was not running"
            if cfg.policy == "fcfs":
                # The most recently admitted running request.
                assert victim is rest[-1], f"victim {victim.request_id}, FCFS picks {rest[-1].request_id}"
            else:
                # The largest (priority, arrival_time); the contract leaves ties open.
                worst = max((r.priority, r.arrival_time) for r in rest)
                assert (victim.priority, victim.arrival_time) == worst, f"victim {victim.request_id}"
            if any(rest.index(victim) < rest.index(r) for r in out.scheduled if r in rest):
                self.seen.add("victim ahead of a scheduled request")
            rest.remove(victim)
            assert victim not in out.scheduled
            assert victim.status is RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0
            assert kv.get_block_ids(victim.request_id) == []
            self.tracks[victim.request_id].drafts = []
        assert len({r.request_id for r in preempted}) == len(preempted)
        # Running order: survivors keep their order, admissions are appended in order.
        admitted = out.admitted
        assert s.running == rest + admitted
        assert len(admitted) == len(out.admitted_block_ids) == len(out.admitted_num_cached_tokens)
        if admitted:
            assert out.scheduled[-len(admitted) :] == admitted
        sched_running = out.scheduled[: len(out.scheduled) - len(admitted)]
        order = {id(r): k for k, r in enumerate(rest)}
        assert all(id(r) in order for r in sched_running), "scheduled a request that is not running"
        assert [order[id(r)] for r in sched_running] == sorted(order[id(r)] for r in sched_running)
        # Running requests come first: one left out means the budget ran out before it.
        if len(sched_running) < len(rest):
            assert out.total_num_scheduled_tokens == budget and not admitted
        waiting_ids = {id(r) for r in waiting_before}
        assert all(id(r) in waiting_ids for r in admitted), "admitted a request that was not waiting"
        # Queue order: FCFS admits from the head and puts victims back at the very front;
        # priority admits the smallest (priority, arrival_time) first.
        left_waiting = [w for w in waiting_before if w not in admitted]
        if cfg.policy == "fcfs":
            assert list(s.waiting) == preempted[::-1] + left_waiting, "FCFS waiting order broken"
            if cfg.max_loras is None:
                assert admitted == waiting_before[: len(admitted)]
        else:
            assert sorted(s.waiting, key=id) == sorted(preempted + left_waiting, key=id)
            keys = [(r.priority, r.arrival_time) for r in admitted]
            assert keys == sorted(keys), "priority admissions out of order"
            if cfg.max_loras is None and admitted:
                assert keys[-1] <= min(((w.priority, w.arrival_time) for w in left_waiting), default=keys[-1])

        # Per-request token counts follow the contract exactly when nothing was preempted.
        left = budget
        for r, n in zip(out.scheduled, out.num_scheduled_tokens):
            rid = r.request_id
            t = self.tracks[rid]
            if r in admitted:
                k = admitted.index(r)
                hit = out.admitted_num_cached_tokens[k]
                assert hit % bs == 0 and 0 <= hit < r.num_tokens
                if not cfg.enable_prefix_caching or r.skip_prefix_cache:
                    assert hit == 0
                assert r.num_computed_tokens == hit + n
                assert out.admitted_block_ids[k] == kv.get_block_ids(rid)
                assert rid not in out.new_block_ids
                # With drafts, a one-token admission may be padded to a full draft step.
                pad = out.spec_decode_tokens.get(rid, [])
                if pad:
                    assert pad == [-1] * cfg.num_speculative_tokens and r.num_tokens - hit == 1
                    self.seen.add("padded admission")
                wanted = r.num_tokens - hit + len(pad)
                cap = wanted
                if not cfg.enable_chunked_prefill:
                    assert n == min(wanted, threshold or wanted), "chunked prefill is off"
                if t.first_hit < 0:
                    t.first_hit = hit
                assert r.num_cached_tokens == t.first_hit, "num_cached_tokens is the first admission's hit"
                if cfg.enable_prefix_caching and not r.skip_prefix_cache:
                    j = 3 if r.num_preemptions else 0
                    self.lookups[j] += 1
                    self.lookups[j + 1] += r.num_tokens
                    self.lookups[j + 2] += hit
                if hit:
                    self.seen.add("prefix-cache hit" + (" after preemption" if r.num_preemptions else ""))
            else:
                before = computed_before[rid]
                assert r.num_computed_tokens == before + n
                drafts = t.drafts
                num_drafts = max(0, before + n - r.num_tokens)
                assert out.spec_decode_tokens.get(rid, []) == drafts[:num_drafts]
                wanted = r.num_tokens - before + len(drafts)
                cap = min(wanted, self.mml - 1 - before)
                table = kv.get_block_ids(rid)
                old = tables_before[rid]
                assert table[: len(old)] == old, "a running request's block table shrank or changed"
                assert out.new_block_ids.get(rid, []) == table[len(old) :]
            assert n <= cap, f"{rid}: scheduled {n} of {cap} tokens it can take"
            if not preempted:
                expect = min(cap, threshold or cap, left)
                assert n == expect, f"{rid}: scheduled {n}, contract says {expect}"
            left -= n
            # The chunk's slots and the lookahead slots are allocated.
            have = len(kv.get_block_ids(rid))
            assert have >= cdiv(min(r.num_computed_tokens + cfg.num_lookahead_tokens, self.mml), bs)
        assert set(out.new_block_ids) <= set(ids)
        assert set(out.spec_decode_tokens) <= set(ids)
        for r in rest:
            if r not in out.scheduled:
                assert kv.get_block_ids(r.request_id) == tables_before[r.request_id]
                assert r.num_computed_tokens == computed_before[r.request_id]

        # Free blocks at each admission, rebuilt backwards from what each admission took out of the
        # free queue: the watermark stays free beside running requests, and with full-prompt
        # reservation the whole current length fitted.
        taken: list[tuple[int, int]] = []
        seen = {b for r in rest for b in kv.get_block_ids(r.request_id)}
        for k in range(len(admitted)):
            table = out.admitted_block_ids[k]
            num_hit = out.admitted_num_cached_tokens[k] // bs
            taken.append((sum(b not in seen for b in table), sum(b not in seen for b in table[:num_hit])))
            seen.update(table)
        free = kv.num_free_blocks
        for k in reversed(range(len(admitted))):
            r, (num_taken, hits_taken) = admitted[k], taken[k]
            reserved = cfg.watermark_blocks if rest or k else 0
            assert free >= reserved, f"{r.request_id} admitted into the watermark"
            free += num_taken
            if cfg.scheduler_reserve_full_isl:
                num_hit = out.admitted_num_cached_tokens[k] // bs
                full = cdiv(min(r.num_tokens, self.mml), bs) - num_hit + hits_taken
                assert free - reserved >= full, f"{r.request_id}: {full} blocks for its prompt, {free} free"
        # LoRA slots.
        if cfg.max_loras is not None:
            loras = {r.lora_id for r in s.running if r.lora_id}
            assert len(loras) <= cfg.max_loras, f"adapters {loras} running, max_loras={cfg.max_loras}"
            if len(loras) == cfg.max_loras and any(w.lora_id not in loras for w in s.waiting if w.lora_id):
                self.seen.add("LoRA slots full")
        # In a cache that holds everything, admission stops only for the budget or max_num_seqs.
        if self.roomy and cfg.enable_chunked_prefill and cfg.max_loras is None and len(s.waiting):
            # (Or the head needs a padded draft step the budget left cannot hold.)
            assert (
                out.total_num_scheduled_tokens == budget
                or len(s.running) >= cfg.max_num_seqs
                or budget - out.total_num_scheduled_tokens < 1 + cfg.num_speculative_tokens
            )

        # The trace, when on, records exactly the decisions made.
        if self.trace:
            tr = out.trace
            assert tr is not None and tr.step == out.step
            got = sorted((e.request_id, e.num_tokens) for e in tr.entries if e.reason is Reason.SCHEDULED)
            assert got == sorted(zip(ids, out.num_scheduled_tokens))
            pre = {e.request_id for e in tr.entries if e.reason is Reason.PREEMPTED}
            assert pre == {r.request_id for r in preempted}
            tr.explain()
            tr.to_json()
        else:
            assert out.trace is None

    # -- the fake executor ---------------------------------------------------------

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Write the shadow KV, check every read, sample tokens and accept a random prefix of the drafts.

        Like an executor holding real KV, it also computes ``[recompute_from, chunk start)`` for
        admitted requests whose prefix-cache hit covers blocks that a withdrawn chunk registered
        but never computed.
        """
        kv, bs, shadow, rng = self.sched.kv, self.bs, self.shadow, self.rng
        recompute = getattr(out, "recompute_from", {})
        hits = dict(zip((r.request_id for r in out.admitted), out.admitted_num_cached_tokens))
        for rid, p in recompute.items():
            assert rid in hits, f"recompute_from for {rid}, which was not admitted this step"
            assert p % bs == 0 and 0 <= p < hits[rid], f"{rid}: recompute_from {p}, hit {hits[rid]}"
        if recompute:
            self.seen.add("hit on a withdrawn chunk's blocks")
        chunks = []
        for r, n in zip(out.scheduled, out.num_scheduled_tokens):
            t = self.tracks[r.request_id]
            codes = self._codes(t)
            table = kv.get_block_ids(r.request_id)
            start = r.num_computed_tokens - n
            assert start >= 0
            drafts = out.spec_decode_tokens.get(r.request_id, [])
            end = r.num_computed_tokens
            assert end <= r.num_tokens + len(drafts), "computed beyond the tokens and drafts"
            assert end < self.mml, "a position at or beyond max_model_len"
            assert len(table) * bs >= end, "scheduled tokens without KV slots"
            parent = codes[r.num_tokens - 1]
            for p in range(recompute.get(r.request_id, start), end):
                if p < r.num_tokens:
                    code = codes[p]
                else:
                    code = parent = self._code(parent, r.lora_id, drafts[p - r.num_tokens])
                shadow[table[p // bs] * bs + p % bs] = code
            chunks.append((r, start, table, codes))
        # Attention reads every earlier position after the whole batch wrote its KV.
        for r, start, table, codes in chunks:
            got = [shadow[table[p // bs] * bs + p % bs] for p in range(start)]
            assert got == codes[:start], f"{r.request_id} reads KV that is not its own prefix"
        sampled: list[list[int]] = []
        proposals: list[list[int]] = []
        k = self.cfg.num_speculative_tokens
        for r in out.scheduled:
            if r.num_computed_tokens >= r.num_tokens:
                drafts = out.spec_decode_tokens.get(r.request_id, [])
                # An admission's padding is no draft: it never matches.
                accepted = 0 if r in out.admitted else rng.randint(0, len(drafts))
                sampled.append([*drafts[:accepted], rng.randrange(self.wl.vocab)])
                proposals.append([rng.randrange(self.wl.vocab) for _ in range(rng.randint(0, k))])
            else:
                sampled.append([])
                proposals.append([])
        return ModelRunnerOutput(sampled_token_ids=sampled, draft_token_ids=proposals if k else None)

    # -- checks after update_from_output() -------------------------------------------

    def _check_update(
        self,
        out: SchedulerOutput,
        result: ModelRunnerOutput,
        res: StepOutputs,
        before: dict[str, tuple[list[int], int]],
        running: list[Request],
    ) -> None:
        """Sampled tokens are applied exactly as the stop rules say; finished requests are released."""
        s = self.sched
        expect_updated, expect_finished = [], []
        for r, toks in zip(out.scheduled, result.sampled_token_ids):
            t = self.tracks[r.request_id]
            old_tokens, _ = before[r.request_id]
            if not toks:
                # A partial prefill chunk: no token, and no drafts to verify next step.
                assert r.token_ids == old_tokens and r.status is RequestStatus.RUNNING
                assert r.num_computed_tokens < r.num_tokens
                t.drafts = []
                continue
            expect_updated.append(r)
            if len(toks) > 1:
                self.seen.add("drafts accepted")
            # Oracle for the stop rules: EOS / stop ids after min_tokens, then the length cap.
            spec = t.spec
            stop_ids = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(spec.eos))
            stop_length = self.wl.stop_length(spec)
            tokens = list(old_tokens)
            status = RequestStatus.RUNNING
            for tok in toks:
                tokens.append(tok)
                if tok in stop_ids and len(tokens) - len(spec.prompt) > spec.min_tokens:
                    status = RequestStatus.FINISHED_STOPPED
                    break
                if len(tokens) >= stop_length:
                    status = RequestStatus.FINISHED_LENGTH_CAPPED
                    break
            assert r.token_ids == tokens, f"{r.request_id}: tokens {r.token_ids[len(old_tokens) :]} kept"
            assert r.num_tokens == len(tokens)
            assert r.status is status, f"{r.request_id}: {r.status.name}, oracle says {status.name}"
            assert r.num_computed_tokens == r.num_tokens - 1
            if status is RequestStatus.FINISHED_STOPPED:
                last = tokens[-1]
                eos = set() if spec.ignore_eos else set(spec.eos)
                assert r.stop_reason == (None if last in eos else last)
            if status.finished:
                self.seen.add(status.name.lower())
                expect_finished.append(r)
                t.drafts = []
                self.live.discard(r.request_id)
                self.unreported.append(r.request_id)
                self.finished_order.append(r.request_id)
                assert r not in s.running and r.request_id not in s.requests
                assert s.kv.get_block_ids(r.request_id) == []
            else:
                k = out.scheduled.index(r)
                t.drafts = list(result.draft_token_ids[k]) if result.draft_token_ids is not None else []
        assert res.updated == expect_updated
        assert res.finished == expect_finished
        # Finished requests leave the running list; the others keep their order.
        assert s.running == [r for r in running if r not in expect_finished]

    # -- global state ---------------------------------------------------------------

    def _check_state(self, after_update: bool) -> None:
        """Queues, statuses, computed counts and the block pool agree with each other."""
        s, cfg, kv, bs = self.sched, self.cfg, self.sched.kv, self.bs
        running, waiting = s.running, list(s.waiting)
        assert set(s.requests) == self.live
        assert s.get_request_counts() == (len(running), len(waiting))
        assert len({id(r) for r in running}) == len(running)
        assert len({id(r) for r in waiting}) == len(waiting)
        assert {r.request_id for r in running} | {r.request_id for r in waiting} == self.live
        assert len(running) + len(waiting) == len(self.live)
        assert len(running) <= cfg.max_num_seqs
        assert s.has_unfinished_requests() == bool(self.live)
        held = [0] * cfg.num_gpu_blocks
        holder: dict[int, tuple[int, str | None]] = {}
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
            assert kv.get_block_ids(r.request_id) == []
        for r in running:
            assert r.status is RequestStatus.RUNNING
            table = kv.get_block_ids(r.request_id)
            assert 0 not in table, f"{r.request_id} holds the null block"
            assert len(set(table)) == len(table), f"{r.request_id} holds a block twice"
            who = (r.lora_id, r.cache_salt)
            for b in table:
                held[b] += 1
                # Only prefix hits share blocks, and never across adapters or cache salts.
                if holder.setdefault(b, who) != who:
                    raise AssertionError(f"block {b} shared across adapters / salts: {who}, {holder[b]}")
            c = r.num_computed_tokens
            assert 0 <= c < self.mml
            if after_update:
                assert c < r.num_tokens, f"{r.request_id}: computed {c} of {r.num_tokens} after update"
            assert len(table) >= cdiv(c, bs), f"{r.request_id}: {len(table)} blocks for {c} tokens"
            most = min(r.num_tokens + cfg.num_speculative_tokens + cfg.num_lookahead_tokens, self.mml)
            assert len(table) <= cdiv(most, bs), f"{r.request_id}: {len(table)} blocks, needs {most} slots"
        for rid in self.finished_order:
            assert kv.get_block_ids(rid) == []
        # Reference counts equal the number of holders; free + used = usable blocks.
        pool = kv.pool
        refs = [b.ref_cnt for b in pool.blocks]
        if refs[1:] != held[1:]:
            b = next(b for b in pool.blocks[1:] if b.ref_cnt != held[b.block_id])
            raise AssertionError(f"{b}: held by {held[b.block_id]} requests")
        num_used = len(holder)
        free_ids = pool.free_queue.block_ids()
        assert len(free_ids) == len(set(free_ids)) == kv.num_free_blocks
        assert sorted(free_ids) == [b for b in range(1, cfg.num_gpu_blocks) if not held[b]]
        assert kv.num_free_blocks + num_used == self.usable
        assert abs(s.kv_usage - num_used / self.usable) < 1e-9
        if not cfg.enable_prefix_caching:
            assert max(held) <= 1, "a block shared without prefix caching"

    def _check_end(self) -> None:
        """Everything drained, every request finished with a reason its tokens justify."""
        s, kv = self.sched, self.sched.kv
        assert not s.has_requests() and not s.has_unfinished_requests()
        assert s.running == [] and len(s.waiting) == 0 and s.requests == {}
        assert s.kv_usage == 0.0 and kv.num_free_blocks == self.usable
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
        assert self.unreported == []
        assert self.live == set()
        # Every request finished or was aborted, and was reported exactly once.
        assert sorted(self.reported) == sorted(self.tracks) and set(self.reported.values()) == {1}
        for rid, t in self.tracks.items():
            r, spec = t.req, t.spec
            assert r.is_finished
            stop_length = self.wl.stop_length(spec)
            out = r.output_token_ids
            assert r.token_ids[: len(spec.prompt)] == list(spec.prompt)
            assert r.num_tokens == len(r.token_ids) <= stop_length
            stop_ids = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(spec.eos))
            stops = [j for j, tok in enumerate(out) if tok in stop_ids and j + 1 > spec.min_tokens]
            if t.aborted:
                assert r.status is RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
                assert stops == [] and r.num_tokens < stop_length
            elif r.status is RequestStatus.FINISHED_LENGTH_CAPPED:
                assert r.finish_reason == "length"
                assert r.num_tokens == min(len(spec.prompt) + spec.max_tokens, self.mml)
                assert stops == []
            else:
                assert r.status is RequestStatus.FINISHED_STOPPED, f"{rid}: {r.status.name}"
                assert r.finish_reason == "stop"
                assert stops == [len(out) - 1], f"{rid}: stop tokens at {stops} of {len(out)}"
        log_final = [
            (rid, t.req.status.name, t.req.token_ids, t.req.num_preemptions, t.req.num_cached_tokens)
            for rid, t in sorted(self.tracks.items())
        ]
        self.log.append(("final", log_final, self.finished_order))
        stats = s.prefix_cache_stats
        assert self.lookups == [
            stats.requests,
            stats.queries,
            stats.hits,
            stats.preempted_requests,
            stats.preempted_queries,
            stats.preempted_hits,
        ]
        if self.cfg.enable_prefix_caching:
            assert s.reset_prefix_cache() is True
            assert kv.pool.num_cached_blocks() == 0


# ---- regressions (shrunk by hypothesis from failures of earlier versions) -------


def _regression(config: dict, requests: list[tuple[str, int, int, int, int]]) -> Workload:
    """A priority workload from (id, prompt length, max_tokens, priority, arrival step) rows."""
    base = {
        "policy": "priority",
        "enable_chunked_prefill": True,
        "scheduler_reserve_full_isl": False,
        "watermark": 0.0,
        "enable_prefix_caching": True,
        "prefix_caching_hash_algo": "sha256",
        "max_loras": None,
        "num_speculative_tokens": 0,
        "num_lookahead_tokens": 0,
    }
    specs = tuple(
        ReqSpec(rid, (0,) * plen, mt, 0, (), (), False, prio, step, float(step), 0, None, False)
        for rid, plen, mt, prio, step in requests
    )
    return Workload({**base, **config}, specs, (), (), 2, 0)


# r0 is scheduled a 1-token chunk that completes a block, then withdrawn and preempted for the
# higher-priority r1; the block stays cached though its last slot was never computed, and r0
# resumes with a hit on it (read KV that does not exist unless the executor recomputes it).
WITHDRAWN_CHUNK_HIT = _regression(
    {
        "max_model_len": 65,
        "block_size": 4,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 3,
        "long_prefill_token_threshold": 1,
        "num_lookahead_tokens": 1,
        "num_gpu_blocks": 18,
    },
    [("r0", 59, 6, 0, 0), ("r1", 3, 6, -16, 16)],
)
# Two requests tied on (priority, arrival_time) in a cache that holds only one of them: with the
# first-in-running-order tie-break each preempts itself in turn, forever.
TIED_VICTIMS = _regression(
    {
        "max_model_len": 84,
        "block_size": 1,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 2,
        "long_prefill_token_threshold": 1,
        "enable_prefix_caching": False,
        "num_gpu_blocks": 8,
    },
    [("r0", 1, 6, 0, 0), ("r1", 1, 7, 0, 0)],
)


# ---- the properties ------------------------------------------------------------


@_settings(600)
@given(wl=workloads())
def test_random_workloads_keep_every_invariant_and_finish(wl: Workload) -> None:
    """Any knob mix and request stream keeps every invariant each step and drains the scheduler cleanly."""
    h = Harness(wl)
    h.run()
    h.report()


@_settings(800)
@given(wl=workloads(pressure=True))
@example(wl=WITHDRAWN_CHUNK_HIT)
@example(wl=TIED_VICTIMS)
def test_priority_preemption_under_cache_pressure(wl: Workload) -> None:
    """Priority preemption in a crowded cache, including withdrawn chunks, keeps KV and state exact."""
    h = Harness(wl)
    h.run()
    h.report()


@_settings(100)
@given(wl=workloads())
def test_debug_mode_checks_pass_and_change_no_decision(wl: Workload) -> None:
    """The built-in debug invariant checks hold on random workloads and leave every decision unchanged."""
    h = Harness(wl, debug=True)
    assert h.run() == Harness(wl).run()
    h.report()


@_settings(100)
@given(wl=workloads())
def test_tracing_changes_no_decision(wl: Workload) -> None:
    """Tracing on records what happened and never changes a decision."""
    h = Harness(wl, trace=True)
    assert h.run() == Harness(wl).run()
    h.report()


@_settings(80)
@given(wl=workloads(max_requests=6, num_rejects=8))
def test_rejected_requests_leave_all_state_untouched(wl: Workload) -> None:
    """Invalid requests are rejected at add_request at any moment without touching any state."""
    h = Harness(wl)
    h.run()
    h.report()
