"""Greedy outputs with n-gram speculation equal those without it, token for token.

Through the engine and scheduler (sync and async scheduling), with chunked
prefill, prefix caching, preemption, and max_tokens, stop tokens and stop
strings landing inside an accepted run of drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from llmsched import LLM, SamplingParams
from llmsched.core import Request, SchedulerConfig
from llmsched.core.speculative import SpeculativeConfig
from llmsched.engine import EngineCore
from llmsched.executor.torch import TorchExecutor

from ..conftest import greedy, prompts_of

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@dataclass
class SpecRun:
    outputs: list[list[int]]
    num_preemptions: int
    # Steps' kept tokens for requests that verified drafts: how many kept beyond the first.
    accepted: int
    drafts: int


def spec_engine(
    model: object,
    *,
    spec: dict | None,
    async_scheduling: bool,
    num_gpu_blocks: int = 512,
    max_num_batched_tokens: int = 256,
) -> EngineCore:
    """EngineCore over the float32 torch executor with ``spec`` (a speculative config, or None)."""
    sc = SpeculativeConfig.parse(spec)
    ex = TorchExecutor(
        model,
        dtype="float32",
        block_size=4,
        max_model_len=128,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        speculative_config=sc,
    )
    config = SchedulerConfig(
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=16,
        async_scheduling=async_scheduling,
        num_speculative_tokens=0 if sc is None else sc.num_speculative_tokens,
        num_lookahead_tokens=0 if sc is None else sc.num_lookahead_tokens,
        debug=True,
    )
    return EngineCore(config, ex)


def run(
    model: object,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    spec: dict | None,
    async_scheduling: bool,
    num_gpu_blocks: int = 512,
    max_num_batched_tokens: int = 256,
) -> SpecRun:
    """Drive EngineCore over the torch executor (float32) until every prompt finishes."""
    engine = spec_engine(
        model,
        spec=spec,
        async_scheduling=async_scheduling,
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    reqs = [Request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
    for r in reqs:
        engine.add_request(r)
    accepted = drafts = 0
    try:
        while engine.has_requests():
            es = engine.step()
            if es is None:
                continue
            # Drafts really verified (async placeholders with no draft behind them are not).
            verified = es.model_output.num_drafts_verified or ()
            for v, toks in zip(verified, es.model_output.sampled_token_ids):
                if v:
                    drafts += v
                    accepted += len(toks) - 1
    finally:
        engine.close()
    return SpecRun([r.output_token_ids for r in reqs], engine.scheduler.num_preemptions, accepted, drafts)


def repeating_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span, so prompt lookup finds drafts."""
    spans = prompts_of([6 + k % 5 for k in range(n)], seed=seed)
    return [(s * 8)[: 20 + 3 * k] for k, s in enumerate(spans)]


def test_greedy_equal_with_chunked_prefill_and_prefix_caching(tiny_models, async_scheduling) -> None:
    model = tiny_models["qwen3" if async_scheduling else "llama"].path
    # A shared 16-token prefix (prefix-cache hits) and a 32-token budget (chunked prefill).
    base = repeating_prompts(4)
    prompts = [base[0][:16] + p for p in base]
    params = [greedy(12 + 5 * k) for k in range(len(prompts))]
    kw = {"async_scheduling": async_scheduling, "max_num_batched_tokens": 32}
    off = run(model, prompts, params, spec=None, **kw)
    on = run(model, prompts, params, spec=NGRAM, **kw)
    assert on.outputs == off.outputs
    assert [len(o) for o in on.outputs] == [12 + 5 * k for k in range(len(prompts))]
    assert on.accepted > 0 and on.drafts > on.accepted


def test_greedy_equal_under_preemption(tiny_models, async_scheduling) -> None:
    model = tiny_models["qwen2"].path
    prompts = repeating_prompts(5, seed=3)
    params = greedy(24)
    kw = {"async_scheduling": async_scheduling, "num_gpu_blocks": 34, "max_num_batched_tokens": 64}
    off = run(model, prompts, params, spec=None, **kw)
    on = run(model, prompts, params, spec=NGRAM, **kw)
    assert on.num_preemptions > 0
    assert on.outputs == off.outputs
    assert on.accepted > 0


def test_max_tokens_and_stop_token_inside_an_accepted_run(tiny_models, async_scheduling) -> None:
    model = tiny_models["mistral"].path
    prompts = repeating_prompts(4, seed=5)
    long = run(model, prompts, greedy(20), spec=None, async_scheduling=async_scheduling).outputs
    # Every cut point 1..16: some land inside an accepted run of drafts.
    params = [greedy(m) for m in range(1, 17)]
    many = [prompts[m % 4] for m in range(16)]
    on = run(model, many, params, spec=NGRAM, async_scheduling=async_scheduling)
    assert on.outputs == [long[m % 4][: m + 1] for m in range(16)]
    # Stop at a token's first appearance after the 5th output token.
    stops = []
    for out in long:
        t = out[5]
        stops.append(SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[t]))
    on = run(model, prompts, stops, spec=NGRAM, async_scheduling=async_scheduling)
    for out, ref in zip(on.outputs, long):
        assert out == ref[: ref.index(ref[5]) + 1]


def test_draft_model_greedy_equal_with_chunking_and_preemption(tiny_models, async_scheduling) -> None:
    """Another tiny model (same vocabulary) drafts; the target itself as its draft accepts everything."""
    target = tiny_models["qwen3"].path
    prompts = repeating_prompts(5, seed=7)
    params = [greedy(10 + 4 * k) for k in range(len(prompts))]
    kw = {"async_scheduling": async_scheduling, "num_gpu_blocks": 34, "max_num_batched_tokens": 32}
    off = run(target, prompts, params, spec=None, **kw)
    other = {"model": str(tiny_models["llama"].path), "num_speculative_tokens": 2}
    on = run(target, prompts, params, spec=other, **kw)
    assert on.outputs == off.outputs
    assert on.drafts > 0
    itself = run(target, prompts, params, spec={"model": str(target), "num_speculative_tokens": 3}, **kw)
    assert itself.outputs == off.outputs
    assert itself.num_preemptions > 0
    # Every draft the target verified is its own greedy choice.
    assert itself.drafts > 0 and itself.accepted == itself.drafts


@pytest.mark.usefixtures("use_embedded")
def test_embedded_model_text_and_stop_strings_equal(async_scheduling) -> None:
    """The embedded model through LLM.generate: same tokens, and stop strings cut inside accepted runs."""
    prompts = ["the cat sat on the mat, the cat sat on the mat, the cat", "a b c d a b c d a b"]
    prompts += ["one two three one two three one", "x y z x y z x y z x y z"]
    plain = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    def generate(params: SamplingParams | list[SamplingParams], spec: dict | None) -> list:
        # float32: verifying drafts batches positions a plain decode runs one by one,
        # and in bfloat16 that rounding alone can flip a greedy choice.
        llm = LLM(
            speculative_config=spec,
            dtype="float32",
            async_scheduling=async_scheduling,
            max_num_batched_tokens=64,
            max_num_seqs=8,
        )
        try:
            return llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.close()

    off = generate(plain, None)
    on = generate(plain, NGRAM)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    texts = [o.outputs[0].text for o in off]
    # Stop strings taken from late in each continuation, where drafts are being accepted.
    stops = [t[len(t) * 2 // 3 : len(t) * 2 // 3 + 2] for t in texts]
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=[s]) for s in stops]
    on_stop = generate(params, NGRAM)
    off_stop = generate(params, None)
    for a, b, s in zip(on_stop, off_stop, stops):
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "stop", s
