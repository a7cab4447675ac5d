"""Admissions padded to a full draft step (1 + K tokens, K placeholder drafts) on the torch executor.

The core scheduler pads an admission with one token left to compute (a
prefix-cache hit up to its last token, a one-token prompt, a resumed
request) as vLLM does. The executor runs its real token only and rejects
every placeholder: outputs and logprobs equal a run without speculation,
no placeholder counts as a verified draft, and real drafts follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from llmsched import SamplingParams
from llmsched.core import Request, SchedulerConfig
from llmsched.core.policy_seam import Policy, PriorityPolicy
from llmsched.core.scheduler import Scheduler
from llmsched.core.speculative import SpeculativeConfig
from llmsched.engine import EngineCore
from llmsched.engine.engine_core import EngineStep
from llmsched.engine.spec_stats import SpecDecodingStats
from llmsched.executor.torch import TorchExecutor

from ..conftest import prompts_of

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PLACEHOLDERS = [-1] * K


class Arrival(NamedTuple):
    """A request and the number of engine.step() calls made before it arrives."""

    at: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0


def repeating_prompts(n: int, seed: int, length: int) -> list[list[int]]:
    """Prompts of ``length`` tokens repeating a short span, so prompt lookup finds drafts."""
    return [(s * length)[:length] for s in prompts_of([5 + k for k in range(n)], seed=seed)]


class PreemptForLate(PriorityPolicy):
    """Priority scheduling, except that a waiting request "late" takes "victim"'s sequence slot."""

    decides_admission = True

    def select_victim(self, running: list[Request], for_request: Request | None = None) -> Request | None:
        """The priority policy's victim; "victim" when "late" waits for a slot."""
        if for_request is None:
            return super().select_victim(running)
        if for_request.request_id == "late":
            return next((r for r in running if r.request_id == "victim"), None)
        return None


@dataclass
class Trace:
    """An engine run: its steps, each request's output and logprobs, the draft counters."""

    steps: list[EngineStep]
    outputs: dict[str, list[int]]
    stats: SpecDecodingStats
    num_preemptions: int
    logprobs: dict[str, list] = field(default_factory=dict)
    config: SchedulerConfig | None = None


def drive(
    model: object,
    arrivals: Sequence[Arrival],
    *,
    spec: dict | None,
    async_scheduling: bool,
    block_size: int = 4,
    max_num_seqs: int = 16,
    policy: Policy | None = None,
) -> Trace:
    """Run EngineCore over the float32 torch executor, adding each request after its number of calls."""
    sc = SpeculativeConfig.parse(spec)
    budget = 16  # prompts of 20+ tokens are chunked
    ex = TorchExecutor(
        model,
        dtype="float32",
        block_size=block_size,
        max_model_len=128,
        num_gpu_blocks=2048 // block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        speculative_config=sc,
    )
    config = SchedulerConfig(
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        async_scheduling=async_scheduling,
        num_speculative_tokens=0 if sc is None else sc.num_speculative_tokens,
        num_lookahead_tokens=0 if sc is None else sc.num_lookahead_tokens,
        debug=True,
    )
    engine = EngineCore(config, ex, policy)
    reqs = {a.request_id: Request(a.request_id, a.prompt, a.params, priority=a.priority) for a in arrivals}
    pending = sorted(arrivals, key=lambda a: a.at)
    steps: list[EngineStep] = []
    stats = SpecDecodingStats(K)
    logprobs: dict[str, list] = {rid: [] for rid in reqs}
    calls = 0
    try:
        while pending or engine.has_requests():
            while pending and pending[0].at <= calls:
                engine.add_request(reqs[pending.pop(0).request_id])
            es = engine.step()
            calls += 1
            if es is None:
                continue
            steps.append(es)
            stats.observe(es.scheduler_output, es.model_output)
            lps = es.model_output.logprobs or ()
            for r, lp in zip(es.scheduler_output.scheduled, lps):
                if lp:
                    logprobs[r.request_id].extend(lp)
    finally:
        engine.close()
    outputs = {rid: r.output_token_ids for rid, r in reqs.items()}
    return Trace(steps, outputs, stats, engine.scheduler.num_preemptions, logprobs, engine.config)


def padded(step: EngineStep) -> list[tuple[int, Request, bool]]:
    """(schedule index, request, resumed) of each admission the step padded with placeholder drafts."""
    so = step.scheduler_output
    resumed = {id(r): res for r, res in zip(so.admitted, so.admitted_resumed)}
    return [
        (i, r, resumed[id(r)])
        for i, r in enumerate(so.scheduled)
        if id(r) in resumed and so.spec_decode_tokens.get(r.request_id) == PLACEHOLDERS
    ]


def prefix_and_one_token_arrivals(max_tokens: int = 14, logprobs: int | None = None) -> list[Arrival]:
    """Two running requests; then the first's prompt again (hit up to its last token) and a 1-token one."""
    a, b = repeating_prompts(2, seed=4, length=21)
    # a: 5 blocks of 4 and one token, so a repeat hits all but its last token
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return [
        Arrival(0, "a", a, sp),
        Arrival(0, "b", b[:14], sp),
        Arrival(6, "a2", a, sp),
        Arrival(6, "one", a[:1], sp),
    ]


def assert_padded_steps_reject_placeholders(trace: Trace, expected: set[str]) -> None:
    """Exactly ``expected`` are padded, to 1 + K tokens; each pad samples one token and verifies none."""
    seen = set()
    for es in trace.steps:
        mo = es.model_output
        for i, r, _ in padded(es):
            seen.add(r.request_id)
            assert es.scheduler_output.num_scheduled_tokens[i] == 1 + K
            assert len(mo.sampled_token_ids[i]) == 1
            assert not mo.num_drafts_verified or mo.num_drafts_verified[i] == 0
    assert seen == expected


def test_padded_admissions_greedy_and_logprobs_equal(tiny_models, async_scheduling) -> None:
    """A prefix hit up to the last token and a one-token prompt, padded; chunked prefill beside them."""
    model = tiny_models["qwen3" if async_scheduling else "llama"].path
    arrivals = prefix_and_one_token_arrivals(logprobs=2)
    off = drive(model, arrivals, spec=None, async_scheduling=async_scheduling)
    on = drive(model, arrivals, spec=NGRAM, async_scheduling=async_scheduling)
    assert on.config is not None and on.config.pad_draft_admissions
    assert_padded_steps_reject_placeholders(on, {"a2", "one"})
    assert on.outputs == off.outputs
    assert on.outputs["a2"] == on.outputs["a"]
    assert on.stats.num_drafts > 0
    for rid, out in on.outputs.items():
        # Async: a step in flight when the request finished samples past its end.
        got, want = on.logprobs[rid][: len(out)], off.logprobs[rid][: len(out)]
        assert [lp.token_id for lp in got] == out
        assert [(lp.token_id, lp.rank) for lp in got] == [(lp.token_id, lp.rank) for lp in want]
        for g, w in zip(got, want):
            assert abs(g.logprob - w.logprob) < 1e-4
            assert [t for t, _ in g.top] == [t for t, _ in w.top]


def test_resumed_request_padded_greedy_equal(tiny_models, async_scheduling) -> None:
    """A preempted request resumes with every token but its last cached: padded, same output."""
    model = tiny_models["qwen2"].path
    a, v, late = repeating_prompts(3, seed=9, length=13)
    arrivals = [
        Arrival(0, "a", a[:10], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
        Arrival(0, "victim", v[:13], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
        # Ahead of "victim" in the waiting queue once that is preempted.
        Arrival(5, "late", late[:9], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), -1),
    ]
    # One-token blocks: a resumed request's cache hit always reaches its last token.
    kw = {"async_scheduling": async_scheduling, "block_size": 1, "max_num_seqs": 2}
    off = drive(model, arrivals, spec=None, policy=PreemptForLate(), **kw)
    on = drive(model, arrivals, spec=NGRAM, policy=PreemptForLate(), **kw)
    assert on.num_preemptions == 1
    resumed = [r.request_id for es in on.steps for _, r, res in padded(es) if res]
    assert resumed == ["victim"]
    assert_padded_steps_reject_placeholders(on, {"victim"})
    assert on.outputs == off.outputs


def test_draft_model_placeholders_not_counted_and_drafts_follow(tiny_models, async_scheduling) -> None:
    """The target drafting for itself keeps every verified draft: a placeholder counted would not be."""
    target = tiny_models["qwen3"].path
    arrivals = prefix_and_one_token_arrivals()
    off = drive(target, arrivals, spec=None, async_scheduling=async_scheduling)
    itself = {"model": str(target), "num_speculative_tokens": K}
    on = drive(target, arrivals, spec=itself, async_scheduling=async_scheduling)
    assert on.outputs == off.outputs
    assert_padded_steps_reject_placeholders(on, {"a2", "one"})
    stats = on.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    for rid in ("a2", "one"):
        at = next(n for n, es in enumerate(on.steps) if any(r.request_id == rid for _, r, _ in padded(es)))
        es = on.steps[at]
        i = next(i for i, r, _ in padded(es) if r.request_id == rid)
        # The padded step's sample is followed by K real drafts (sync: handed to the scheduler)...
        if not async_scheduling:
            assert len(es.model_output.draft_token_ids[i]) == K
        # ... which a later step verifies in full.
        later = [
            (s.model_output.num_drafts_verified or ())[k]
            for s in on.steps[at + 1 :]
            for k, r in enumerate(s.scheduler_output.scheduled)
            if r.request_id == rid and s.model_output.num_drafts_verified
        ]
        assert later and later[0] == K


def test_engine_pads_as_the_core_scheduler_decides(tiny_models) -> None:
    """Replaying the engine's model outputs through a bare core Scheduler schedules the same steps."""
    model = tiny_models["llama"].path
    arrivals = prefix_and_one_token_arrivals()
    on = drive(model, arrivals, spec=NGRAM, async_scheduling=False)
    assert on.config is not None
    sched = Scheduler(replace(on.config, pad_draft_admissions=True))
    pending = sorted(arrivals, key=lambda a: a.at)
    for calls, es in enumerate(on.steps):
        while pending and pending[0].at <= calls:
            a = pending.pop(0)
            sched.add_request(Request(a.request_id, a.prompt, a.params))
        so = sched.schedule()
        want = es.scheduler_output
        assert [r.request_id for r in so.scheduled] == [r.request_id for r in want.scheduled]
        assert so.num_scheduled_tokens == want.num_scheduled_tokens
        assert so.spec_decode_tokens == want.spec_decode_tokens
        sched.update_from_output(so, es.model_output)
    assert not sched.has_unfinished_requests()
    assert any(padded(es) for es in on.steps)
