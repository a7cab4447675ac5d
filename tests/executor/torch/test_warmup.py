"""The start-up warm-up: it runs before the first request, pays the first-time costs, and leaves no trace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import llmsched.executor.torch.executor as executor_module
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.executor.torch import TorchExecutor, kernels
from llmsched.executor.torch.warmup import PREFILL_TOKENS, SAMPLED_TOKENS
from support.tiny_bamba import build_tiny_bamba


@pytest.fixture(scope="module")
def tiny_bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bamba_warmup")
    build_tiny_bamba(folder)
    return folder


def _assert_untouched(ex: TorchExecutor, seed: int) -> None:
    """No scratch request, rows in their first order, a zero KV cache (and states), the seed's generator."""
    assert ex.batch.states == {}
    assert ex.batch._free_rows == list(range(ex._max_num_seqs - 1, -1, -1))
    assert not bool(ex.batch.block_table.any())
    assert all(not bool(layer.any()) for layer in ex.kv_cache.blocks)
    states = getattr(ex, "mamba_states", None)
    if states is not None:
        assert not bool(states.conv.any()) and not bool(states.ssm.any())
    fresh = torch.Generator().manual_seed(seed)
    assert torch.equal(ex.sampler.generator.get_state(), fresh.get_state())


def test_warm_up_runs_a_prefill_and_a_decode_and_leaves_no_trace(tiny_models) -> None:
    ex = TorchExecutor(
        tiny_models["llama"].path, dtype="float32", num_gpu_blocks=64, max_model_len=256, seed=3
    )
    try:
        assert ex.warmup is not None
        assert ex.warmup.prompt_tokens == (PREFILL_TOKENS, SAMPLED_TOKENS)
        assert ex.warmup.steps == 2
        _assert_untouched(ex, seed=3)
    finally:
        ex.close()


def test_warm_up_fits_small_caches_and_limits(tiny_models) -> None:
    path = tiny_models["llama"].path
    # 4 usable blocks of 4 tokens: 8 + 1 tokens take 3, so the greedy prompt gets one block (3 + 1 tokens).
    ex = TorchExecutor(path, dtype="float32", num_gpu_blocks=5, block_size=4, max_model_len=16)
    try:
        assert ex.warmup is not None and ex.warmup.prompt_tokens == (3, SAMPLED_TOKENS)
        _assert_untouched(ex, seed=0)
    finally:
        ex.close()
    ex = TorchExecutor(path, dtype="float32", num_gpu_blocks=64, max_num_seqs=1, max_num_batched_tokens=5)
    try:
        # One row: only the sampled request, its prompt cut to the token budget.
        assert ex.warmup is not None and ex.warmup.prompt_tokens == (5,)
        _assert_untouched(ex, seed=0)
    finally:
        ex.close()
    # One usable block of 4 tokens: the sampled request alone, 3 prompt tokens and its decode.
    ex = TorchExecutor(path, dtype="float32", num_gpu_blocks=2, block_size=4, max_model_len=4)
    try:
        assert ex.warmup is not None and ex.warmup.prompt_tokens == (3,)
        _assert_untouched(ex, seed=0)
    finally:
        ex.close()


def test_hybrid_warm_up_zeroes_the_state_blocks_it_wrote(tiny_bamba: Path) -> None:
    ex = TorchExecutor(tiny_bamba, dtype="float32", num_gpu_blocks=64, block_size=16, max_model_len=128)
    try:
        assert ex.warmup is not None and ex.warmup.steps == 2
        _assert_untouched(ex, seed=0)
    finally:
        ex.close()


def test_engine_state_after_warm_up_is_a_fresh_engines(tiny_models) -> None:
    engine = LLMEngine(
        EngineArgs(model=str(tiny_models["llama"].path), dtype="float32", skip_tokenizer_init=True)
    )
    try:
        assert engine.executor.warmup is not None
        sched = engine.engine_core.scheduler
        kv = sched.kv
        assert kv.num_free_blocks == engine.scheduler_config.num_gpu_blocks - 1  # all but the null block
        assert kv.pool.num_cached_blocks() == 0
        assert sched.next_step == 0 and engine.num_steps == 0
        assert any(n.startswith("warm-up: 2 dummy steps") for n in engine.startup_notes)
        assert any(n.startswith("CPU path for ") for n in engine.startup_notes)
    finally:
        engine.close()


def test_random_sampling_is_as_without_warm_up(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unseeded sampling draws from the executor's generator: the warm-up's draws must not shift it."""
    from llmsched import LLM

    path = str(tiny_models["llama"].path)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [10, 11, 12]}]

    def run() -> list[list[int]]:
        llm = LLM(path, dtype="float32", seed=11, skip_tokenizer_init=True)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()

    warmed = run()
    monkeypatch.setattr(executor_module, "warm_up", lambda ex, n: None)
    assert run() == warmed


def test_lazy_first_time_work_happens_before_the_first_request(tiny_models) -> None:
    """The bfloat16 RMSNorm kernels are looked up (built, loaded, checked) on first use: at start-up now."""
    kernels.clear_caches()
    engine = LLMEngine(
        EngineArgs(
            model=str(tiny_models["llama"].path), dtype="bfloat16", device="cpu", skip_tokenizer_init=True
        )
    )
    try:
        assert kernels.rms_norm_kernels.cache_info().misses == 1
        assert kernels.library.cache_info().misses == 1
        engine.add_request("r", {"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        # The first request found them loaded.
        assert kernels.rms_norm_kernels.cache_info().misses == 1
        assert kernels.library.cache_info().misses == 1
    finally:
        engine.close()
