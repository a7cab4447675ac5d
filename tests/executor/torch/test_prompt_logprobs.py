"""Prompt logprobs equal transformers' log_softmax over the prompt, across prefill chunks and cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor.torch.conftest import TinyModel, prompts_of
from llmsched import LLM, SamplingParams
from llmsched.core.trace import PREFIX_CACHE_NOT_READ


def reference(folder: Path, prompt: list[int], hf: torch.nn.Module | None = None) -> torch.Tensor:
    """transformers' float32 log-probabilities, [len(prompt), vocab]."""
    if hf is None:
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def check(plp: list, prompt: list[int], ref: torch.Tensor, k: int, first: int = 1) -> None:
    """From position ``first``: the prompt token's logprob and rank, the top-k, as in transformers."""
    assert len(plp) == len(prompt) and all(e is None for e in plp[:first])
    for pos in range(first, len(prompt)):
        row, tok = ref[pos - 1], prompt[pos]
        entry = plp[pos]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4, pos
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = torch.topk(row, k).indices.tolist() if k else []
        assert set(entry) == {tok, *top}
        # As vLLM: the prompt token first, then the top-k by rank.
        assert next(iter(entry)) == tok
        for tid in top:
            assert abs(entry[tid].logprob - row[tid].item()) < 1e-4


def byte_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Random prompts within the embedded model's byte vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def llm(folder: Path, **kw: object) -> LLM:
    """A float32 engine with 16-token blocks and a 16-token budget: a 50-token prompt runs in 4 chunks."""
    kw = {"dtype": "float32", "block_size": 16, "max_num_batched_tokens": 16, **kw}
    return LLM(str(folder), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_hf_models_across_chunks(
    tiny_models: dict[str, TinyModel], family: str, scheduling_mode: bool
) -> None:
    tm = tiny_models[family]
    prompt = prompts_of([50], seed=3)[0]
    engine = llm(tm.path, skip_tokenizer_init=True)
    out = engine.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    )
    ref = reference(tm.path, prompt, tm.hf.float())
    check(out[0].prompt_logprobs, prompt, ref, 2)
    # The first sampled token still comes from the last prompt position.
    assert out[0].outputs[0].token_ids[0] == int(ref[-1].argmax())


def test_embedded_model_batched_with_plain_requests(use_embedded: Path, scheduling_mode: bool) -> None:
    folder = use_embedded
    prompts = byte_prompts([37, 21, 50], seed=5)
    engine = llm(folder, max_num_batched_tokens=24)
    plain = SamplingParams(max_tokens=4, temperature=0)
    asks = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], [asks, plain, asks])
    for i in (0, 2):
        check(outs[i].prompt_logprobs, prompts[i], reference(folder, prompts[i]), 0)
    assert outs[1].prompt_logprobs is None
    # Greedy outputs are those of an engine where nobody asked.
    again = llm(folder, max_num_batched_tokens=24).generate([{"prompt_token_ids": p} for p in prompts], plain)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]


def run_traced(engine: LLM, rid: str, prompt: list[int], params: SamplingParams) -> tuple[object, list[str]]:
    """Run one request step by step; its final output and its trace details of every step."""
    eng = engine.llm_engine
    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    details: list[str] = []
    final = None
    for _ in range(50):
        outs = eng.step()
        trace = eng.engine_core.last_scheduled.trace
        entry = trace.reason_of(rid) if trace is not None else None
        if entry is not None:
            details.append(entry.detail)
        final = next((o for o in outs if o.request_id == rid and o.finished), final)
        if final is not None:
            return final, details
    raise AssertionError(f"{rid} did not finish")


def test_a_cached_prefix_is_not_read_and_the_trace_says_so(use_embedded: Path, scheduling_mode: bool) -> None:
    folder = use_embedded
    prompt = byte_prompts([50], seed=7)[0]
    engine = llm(folder, max_num_batched_tokens=64)
    engine.llm_engine.scheduler.enable_trace()
    plain = SamplingParams(max_tokens=2, temperature=0)
    run_traced(engine, "cold", prompt, plain)
    warm, details = run_traced(engine, "warm", prompt, plain)
    assert warm.num_cached_tokens == 48
    assert not any(PREFIX_CACHE_NOT_READ in d for d in details)
    out, details = run_traced(
        engine, "asks", prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    )
    assert out.num_cached_tokens == 0
    assert any(PREFIX_CACHE_NOT_READ in d for d in details), details
    ref = reference(folder, prompt)
    check(out.prompt_logprobs, prompt, ref, 1)
    # Told to read it: a hit, and logprobs only for the positions computed after it.
    reads = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, skip_reading_prefix_cache=False)
    hit, _ = run_traced(engine, "reads", prompt, reads)
    assert hit.num_cached_tokens == 48
    check(hit.prompt_logprobs, prompt, ref, 1, first=49)


def test_a_one_token_prompt_has_only_none(use_embedded: Path) -> None:
    out = llm(use_embedded).generate(
        [{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1, prompt_logprobs=1)
    )
    assert out[0].prompt_logprobs == [None]
