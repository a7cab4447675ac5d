"""Sampling through the whole engine: seeds survive batching and preemption, top_k=1 is greedy."""

from __future__ import annotations

from llmsched.core import SamplingParams

from .conftest import greedy, prompts_of, run_engine


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)


def test_seeded_output_does_not_depend_on_the_batch(tiny_models, async_scheduling):
    """Nor on the scheduling mode: the mixes run in either, the reference alone in sync mode."""
    model = tiny_models["qwen3"]
    target = prompts_of([13], seed=20)[0]
    alone = run_engine(model.path, [target], seeded(7)).outputs[0]
    others = prompts_of([4, 30, 9, 21], seed=21)
    mixes = [
        # Other requests first, some seeded, some not, one greedy.
        ([*others, target], [seeded(1), SamplingParams(max_tokens=16), greedy(16), seeded(2), seeded(7)], {}),
        # Target first, chunked prefills, tiny budget.
        (
            [target, *others],
            [seeded(7)] + [SamplingParams(max_tokens=9)] * 4,
            {"max_num_batched_tokens": 8, "max_num_seqs": 4},
        ),
        # A cache so small that requests are preempted and recomputed.
        (
            [*others, target],
            [SamplingParams(max_tokens=16)] * 4 + [seeded(7)],
            {"num_gpu_blocks": 20, "max_model_len": 64},
        ),
    ]
    for prompts, params, kw in mixes:
        run = run_engine(model.path, prompts, params, async_scheduling=async_scheduling, **kw)
        assert run.outputs[prompts.index(target)] == alone
        if "num_gpu_blocks" in kw:
            assert run.engine.scheduler.num_preemptions > 0
    # A different seed gives a different continuation.
    assert run_engine(model.path, [target], seeded(8)).outputs[0] != alone


def test_unseeded_sampling_actually_samples(tiny_models):
    model = tiny_models["llama"]
    prompt = prompts_of([10], seed=22)[0]
    outs = run_engine(model.path, [prompt] * 6, SamplingParams(max_tokens=8, temperature=1.5)).outputs
    assert len({tuple(o) for o in outs}) > 1


def test_top_k_1_sampling_equals_greedy(tiny_models):
    model = tiny_models["qwen2"]
    prompts = prompts_of([5, 12, 27], seed=23)
    sampled = run_engine(
        model.path, prompts, SamplingParams(max_tokens=10, temperature=0.8, top_k=1, ignore_eos=True)
    )
    assert sampled.outputs == [model.greedy(p, 10) for p in prompts]


def test_penalties_change_the_output(tiny_models):
    model = tiny_models["llama"]
    prompt = prompts_of([6], seed=24)[0]
    plain = model.greedy(prompt, 20)
    params = SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=2.0, ignore_eos=True)
    out = run_engine(model.path, [prompt], params).outputs[0]
    assert out != plain
    # Counts follow the executor's own samples, so async mode (a step ahead
    # of the Request) penalises exactly the same tokens.
    assert run_engine(model.path, [prompt], params, async_scheduling=True).outputs[0] == out
    # A strong frequency penalty spreads the output over more distinct tokens.
    assert len(set(out)) >= len(set(plain))
