"""TorchExecutor driven by EngineCore: token-for-token equality with transformers' greedy generate()."""

from __future__ import annotations

import pytest
import torch

from llmsched.core import SamplingParams
from llmsched.engine import Executor
from llmsched.executor.torch import TorchExecutor

from .conftest import TinyModel, greedy, prompts_of, run_engine

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
LENGTHS = [3, 17, 9, 40, 26, 1]


def references(model: TinyModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding)."""
    return [model.greedy(p, max_tokens) for p in prompts]


def test_implements_the_executor_protocol(tiny_models):
    ex = TorchExecutor(tiny_models["llama"].path, dtype="float32", num_gpu_blocks=16, max_model_len=64)
    assert isinstance(ex, Executor)
    assert ex.num_gpu_blocks == 16
    assert ex.max_model_len == 64
    assert ex.dtype is torch.float32
    assert ex.device.type == "cpu"
    assert ex.model_config.architecture == "LlamaForCausalLM"
    ex.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_different_lengths_matches_transformers(tiny_models, family, async_scheduling):
    model = tiny_models[family]
    prompts = prompts_of(LENGTHS, seed=1)
    run = run_engine(model.path, prompts, greedy(12), async_scheduling=async_scheduling)
    assert run.outputs == references(model, prompts, 12)
    # Everything ran in one batch: several requests decoded together.
    assert max(sum(1 for _, n, _ in s.entries if n == 1) for s in run.steps) == len(prompts)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_transformers(tiny_models, family, async_scheduling):
    model = tiny_models[family]
    prompts = prompts_of(LENGTHS, seed=2)
    run = run_engine(
        model.path,
        prompts,
        greedy(10),
        async_scheduling=async_scheduling,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    assert run.num_chunked > 5
    assert run.num_mixed_steps > 0
    assert run.outputs == references(model, prompts, 10)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_match_transformers(tiny_models, family, async_scheduling):
    model = tiny_models[family]
    shared = prompts_of([23], seed=3)[0]
    tails = prompts_of([1, 6, 13, 2], seed=4)
    prompts = [shared + t for t in tails]
    # Budget 16: the first request computes the shared blocks over two steps
    # while the others wait, so they are admitted onto cached blocks.
    run = run_engine(
        model.path,
        prompts,
        greedy(8),
        async_scheduling=async_scheduling,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    stats = run.engine.scheduler.prefix_cache_stats
    assert stats.hits >= 3 * 20
    assert run.outputs == references(model, prompts, 8)
    # A later request finds the freed but still cached blocks.
    late = shared + prompts_of([5], seed=5)[0]
    engine = run.engine
    from llmsched.core import Request

    req = Request("late", late, greedy(8))
    before = stats.hits
    engine.add_request(req)
    while engine.has_requests():
        engine.step()
    assert engine.scheduler.prefix_cache_stats.hits - before >= 20
    assert req.output_token_ids == model.greedy(late, 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_and_recompute_match_transformers(tiny_models, family, async_scheduling):
    model = tiny_models[family]
    prompts = prompts_of([30, 21, 26, 17, 28], seed=6)
    # 15 usable blocks of 4 tokens: any two requests at full length overflow.
    run = run_engine(
        model.path,
        prompts,
        greedy(24),
        async_scheduling=async_scheduling,
        num_gpu_blocks=16,
        max_model_len=60,
        max_num_batched_tokens=32,
    )
    assert run.engine.scheduler.num_preemptions > 0
    assert sum(s.num_preempted for s in run.steps) > 0
    assert run.outputs == references(model, prompts, 24)


def test_prefill_chunks_after_prefix_hits_and_preemption_together(tiny_models, async_scheduling):
    model = tiny_models["qwen3"]
    shared = prompts_of([14], seed=7)[0]
    prompts = [shared + t for t in prompts_of([9, 3, 16, 11, 5, 12], seed=8)]
    run = run_engine(
        model.path,
        prompts,
        greedy(20),
        async_scheduling=async_scheduling,
        num_gpu_blocks=20,
        max_model_len=52,
        max_num_batched_tokens=12,
        max_num_seqs=6,
    )
    assert run.engine.scheduler.num_preemptions > 0
    assert run.engine.scheduler.prefix_cache_stats.hits > 0
    assert run.num_chunked > 0
    assert run.outputs == references(model, prompts, 20)


def test_block_size_16_and_a_single_long_prompt(tiny_models, async_scheduling):
    model = tiny_models["llama"]
    prompts = prompts_of([150, 2, 64], seed=9)
    run = run_engine(
        model.path,
        prompts,
        greedy(30),
        async_scheduling=async_scheduling,
        block_size=16,
        max_model_len=256,
        num_gpu_blocks=64,
    )
    assert run.outputs == references(model, prompts, 30)


def test_decode_groups_split_by_context_length(tiny_models, monkeypatch, async_scheduling):
    """Forcing many small decode groups (as on CPU with long contexts) changes nothing."""
    model = tiny_models["qwen2"]
    import llmsched.executor.torch.executor as executor_module

    monkeypatch.setattr(executor_module, "DECODE_GROUP_BYTES", 1)
    prompts = prompts_of([5, 33, 12, 20, 2, 47, 8], seed=10)
    run = run_engine(model.path, prompts, greedy(10), async_scheduling=async_scheduling)
    assert run.executor.batch.decode_group_bytes == 1
    assert run.outputs == references(model, prompts, 10)


def test_eos_stops_and_min_tokens_holds_it_back(tiny_models, async_scheduling):
    model = tiny_models["llama"]
    prompt = prompts_of([11], seed=11)[0]
    ref = model.greedy(prompt, 12)
    eos = ref[3]
    first = ref.index(eos)
    # Stop at the first occurrence of the chosen token...
    run = run_engine(
        model.path,
        [prompt],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[eos]),
        async_scheduling=async_scheduling,
    )
    assert run.outputs[0] == ref[: first + 1]
    # ...unless min_tokens masks it: then greedy picks something else there.
    held = run_engine(
        model.path,
        [prompt],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[eos], min_tokens=first + 1),
        async_scheduling=async_scheduling,
    )
    out = held.outputs[0]
    assert eos not in out[: first + 1]
    assert len(out) > first + 1
    # The min_tokens mask counts the executor's own samples, which run a step
    # ahead of the request in async mode: both modes mask the same positions.
    sync = run_engine(
        model.path,
        [prompt],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[eos], min_tokens=first + 1),
    )
    assert out == sync.outputs[0]


def test_logprobs_are_the_raw_model_distribution(tiny_models):
    model = tiny_models["qwen3"]
    prompt = prompts_of([9], seed=12)[0]
    ex = TorchExecutor(model.path, dtype="float32", num_gpu_blocks=64, max_model_len=64, block_size=4)
    from llmsched.core import Request, SchedulerConfig
    from llmsched.engine import EngineCore

    engine = EngineCore(
        SchedulerConfig(
            num_gpu_blocks=64, max_model_len=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4
        ),
        ex,
    )
    req = Request("lp", prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))
    plain = Request("plain", prompt, greedy(4))
    engine.add_request(req)
    engine.add_request(plain)
    seen = []
    while engine.has_requests():
        es = engine.step()
        for r, lp in zip(es.scheduler_output.scheduled, es.model_output.logprobs or []):
            if r.request_id == "plain":
                assert lp is None
            elif lp is not None:
                seen.append(lp)
    assert len(seen) == 4
    tokens = prompt + req.output_token_ids
    with torch.no_grad():
        logits = model.hf(torch.tensor([tokens])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    for k, entry in enumerate(seen):
        (tl,) = entry
        pos = len(prompt) - 1 + k
        assert tl.token_id == req.output_token_ids[k]
        assert tl.rank == 1
        assert tl.logprob == pytest.approx(ref[pos, tl.token_id].item(), abs=1e-4)
        values, ids = ref[pos].topk(3)
        assert [t for t, _ in tl.top] == ids.tolist()
        assert [v for _, v in tl.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_bfloat16_runs_and_mostly_agrees(tiny_models, async_scheduling):
    """bf16 is not bit-exact, but a healthy bf16 path agrees with float32 on most first tokens."""
    model = tiny_models["llama"]
    prompts = prompts_of([7, 19, 30, 12, 25, 4, 16, 9], seed=13)
    ex = TorchExecutor(model.path, dtype="bfloat16", num_gpu_blocks=128, max_model_len=64, block_size=4)
    assert ex.dtype is torch.bfloat16
    assert ex.kv_cache.key[0].dtype is torch.bfloat16
    run = run_engine(model.path, prompts, greedy(4), async_scheduling=async_scheduling, executor=ex)
    ref = references(model, prompts, 4)
    agree = sum(o[0] == r[0] for o, r in zip(run.outputs, ref))
    assert agree >= 6


def test_finished_and_aborted_requests_release_executor_state(tiny_models, async_scheduling):
    model = tiny_models["qwen2"]
    prompts = prompts_of([6, 9, 14], seed=14)
    run = run_engine(model.path, prompts, greedy(5), async_scheduling=async_scheduling)
    batch = run.executor.batch
    assert batch.states == {}
    assert sorted(batch._free_rows) == list(range(batch.block_table.shape[0]))
    assert int(batch.block_table.abs().sum()) == 0


def test_prefault_touches_the_whole_cache_and_changes_no_output(tiny_models):
    model = tiny_models["llama"]
    prompts = prompts_of([5, 9], seed=3)
    before = run_engine(model.path, prompts, greedy(6)).outputs
    ex = TorchExecutor(model.path, dtype="float32", num_gpu_blocks=16, max_model_len=64)
    blocks = ex.kv_cache.blocks
    assert ex.prefault_kv_cache() == sum(b.numel() * b.element_size() for b in blocks) > 0
    assert all(not b.any() for b in blocks)
    ex.close()
    assert run_engine(model.path, prompts, greedy(6)).outputs == before


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_equal_length_prompts_on_one_thread_match_transformers(tiny_models, family):
    # On one thread, adjacent equal-length fresh prompts share one attention call per layer.
    model = tiny_models[family]
    prompts = prompts_of([12, 12, 12, 5, 5, 9], seed=4)
    threads = torch.get_num_threads()
    try:
        run = run_engine(model.path, prompts, greedy(8), num_threads=1)
    finally:
        torch.set_num_threads(threads)
    assert run.outputs == references(model, prompts, 8)
