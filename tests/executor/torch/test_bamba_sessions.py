"""Streaming-input sessions on the tiny random Bamba keep the Mamba states between turns.

Each turn must equal transformers' greedy generate on the whole history
(earlier inputs, earlier outputs but each turn's last sampled token, then
the new input), offline (``LLM.session``) and through ``AsyncEngine.generate``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import BambaForCausalLM

from llmsched import LLM, SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.sessions import StreamingInput
from llmsched.server.async_engine import AsyncEngine
from llmsched.server.thread_backend import ThreadBackend
from support.hf_reference import hf_greedy
from support.tiny_bamba import VOCAB, build_tiny_bamba

BLOCK = 4
# Turn inputs of lengths that leave the history on and off block boundaries.
LENGTHS = [(13, 5), (6, 4), (9, 3)]


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BambaForCausalLM]:
    folder = tmp_path_factory.mktemp("bamba-sessions")
    return folder, build_tiny_bamba(folder)


def turn_inputs(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n, _ in LENGTHS]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def expected_turns(hf: BambaForCausalLM, inputs: list[list[int]]) -> list[list[int]]:
    """transformers' greedy output of each turn on its history."""
    history: list[int] = []
    outs = []
    for ids, (_, max_tokens) in zip(inputs, LENGTHS):
        if outs:
            history += outs[-1][:-1]
        history += ids
        outs.append(hf_greedy(hf, history, max_tokens))
    return outs


def engine_args(folder: Path, **kw: object) -> dict:
    return dict(
        model=str(folder),
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=BLOCK,
        num_gpu_blocks_override=96,
        max_model_len=96,
        **kw,
    )


@pytest.mark.parametrize(
    "kw",
    [{}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 8}],
    ids=["caching", "no-caching", "chunked"],
)
def test_offline_session_turns_equal_transformers_on_the_history(
    bamba: tuple[Path, BambaForCausalLM], kw: dict, scheduling_mode: bool
) -> None:
    folder, hf = bamba
    inputs_a, inputs_b = turn_inputs(1), turn_inputs(2)
    llm = LLM(**engine_args(folder, **kw))
    try:
        assert llm.llm_engine.scheduler_config.mamba
        free0 = llm.llm_engine.scheduler.kv.num_free_blocks
        # Two sessions, their turns interleaved, so each resumes its own state blocks.
        a, b = llm.session(), llm.session()
        got_a, got_b = [], []
        for (ids_a, ids_b), (_, max_tokens) in zip(zip(inputs_a, inputs_b), LENGTHS):
            got_a.append(a.send({"prompt_token_ids": ids_a}, greedy(max_tokens)).outputs[0].token_ids)
            got_b.append(b.send({"prompt_token_ids": ids_b}, greedy(max_tokens)).outputs[0].token_ids)
        a.close()
        b.close()
        assert llm.llm_engine.scheduler.kv.num_free_blocks == free0
    finally:
        llm.close()
    assert got_a == expected_turns(hf, inputs_a)
    assert got_b == expected_turns(hf, inputs_b)


async def feed(inputs: list[list[int]], turn_ended: asyncio.Event) -> AsyncIterator[StreamingInput]:
    """Each input once the previous turn ended, so every turn resumes a session waiting for input."""
    for k, (ids, (_, max_tokens)) in enumerate(zip(inputs, LENGTHS)):
        if k:
            await turn_ended.wait()
            turn_ended.clear()
        yield StreamingInput({"prompt_token_ids": ids}, greedy(max_tokens))


def test_async_engine_session_equals_transformers(
    bamba: tuple[Path, BambaForCausalLM], scheduling_mode: bool
) -> None:
    folder, hf = bamba
    inputs = turn_inputs(3)

    async def main() -> list[list[int]]:
        engine = AsyncEngine(ThreadBackend(LLMEngine(EngineArgs(**engine_args(folder)))))
        engine.start()
        turns: list[list[int]] = [[]]
        ended = asyncio.Event()
        try:
            async for out in engine.generate(feed(inputs, ended), greedy(1), "s"):
                turns[-1] += out.token_ids
                if out.finish_reason is not None and not out.finished:
                    turns.append([])
                    ended.set()
        finally:
            await engine.stop()
        return [t for t in turns if t]

    assert asyncio.run(main()) == expected_turns(hf, inputs)
