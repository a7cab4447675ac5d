"""Async scheduling on the real model: the same text as sync mode, stops and aborts found a step late.

The engine plans step N+1 while the executor's thread runs step N, so a
decode's input token is often one the executor sampled itself and the
Request does not hold yet. These tests run the embedded demo model (a real
tokenizer, so stop strings apply) through the public API in both modes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsched import LLM, SamplingParams
from llmsched.executor.torch.input_batch import InputBatch

from .conftest import greedy, prompts_of, run_engine

PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "Hello", "A long, long way"]


def generate(prompts: list[str], params: SamplingParams | list[SamplingParams], **kwargs: object) -> list:
    """LLM.generate on the embedded model; the engine closed afterwards."""
    llm = LLM(**kwargs)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()


@pytest.mark.usefixtures("use_embedded")
def test_greedy_text_and_stop_strings_equal_sync_mode() -> None:
    plain = [o.outputs[0].text for o in generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))]
    # A stop string from the middle of each greedy continuation.
    stops = [text[8:10] for text in plain]
    params = [SamplingParams(max_tokens=24, temperature=0, stop=[s]) for s in stops]
    runs = {mode: generate(PROMPTS, params, async_scheduling=mode) for mode in (False, True)}
    for mode, outs in runs.items():
        for out, text, stop in zip(outs, plain, stops):
            cut = text.index(stop)
            assert out.outputs[0].text == text[:cut], (mode, stop)
            assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert [o.outputs[0].token_ids for o in runs[True]] == [o.outputs[0].token_ids for o in runs[False]]


@pytest.mark.usefixtures("use_embedded")
def test_seeded_sampling_and_preemption_equal_sync_mode() -> None:
    params = [
        SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=k, ignore_eos=True)
        for k in range(len(PROMPTS))
    ]
    # A KV cache of a few 16-token blocks: requests are preempted and recomputed.
    small = {
        "block_size": 16,
        "num_gpu_blocks_override": 12,
        "max_model_len": 128,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
    }
    runs = {}
    for mode in (False, True):
        llm = LLM(async_scheduling=mode, **small)
        try:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            assert llm.llm_engine.scheduler.num_preemptions > 0
        finally:
            llm.close()
        runs[mode] = [o.outputs[0].token_ids for o in outs]
    assert runs[True] == runs[False]
    assert all(len(t) == 40 for t in runs[True])


@pytest.mark.usefixtures("use_embedded")
def test_abort_in_flight_leaks_no_token_and_others_finish_unchanged() -> None:
    reference = [o.outputs[0].token_ids for o in generate(PROMPTS, greedy(20), async_scheduling=False)]
    llm = LLM(async_scheduling=True)
    engine = llm.llm_engine
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, greedy(20))
        seen: dict[str, list[int]] = {}
        while len(seen.get("0", ())) < 5:
            for out in engine.step():
                seen[out.request_id] = out.outputs[0].token_ids
        # Request 0's next step is in flight on the executor's thread.
        assert engine.engine_core.num_in_flight == 1
        (aborted,) = engine.abort_request("0")
        assert aborted.outputs[0].token_ids == seen["0"] == reference[0][:5]
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id != "0"
                seen[out.request_id] = out.outputs[0].token_ids
        assert [seen[str(i)] for i in range(1, len(PROMPTS))] == reference[1:]
        assert engine.scheduler.kv.usage == 0.0
    finally:
        llm.close()


def test_decode_inputs_come_from_the_executors_own_samples(tiny_models, monkeypatch) -> None:
    """Async mode plans decodes whose input the executor has not sampled yet; sync mode never does."""
    model = tiny_models["llama"]
    holes: list[int] = []
    prepare = InputBatch.prepare

    def counting(self: InputBatch, so: object) -> object:
        step = prepare(self, so)
        holes.append(len(step.holes))
        return step

    monkeypatch.setattr(InputBatch, "prepare", counting)
    prompts = prompts_of([3, 17, 9, 40], seed=30)
    for mode in (False, True):
        holes.clear()
        run = run_engine(Path(model.path), prompts, greedy(12), async_scheduling=mode)
        assert run.outputs == [model.greedy(p, 12) for p in prompts]
        assert (sum(holes) > 0) is mode
