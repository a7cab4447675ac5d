"""LoRA through the engine: LLM.generate(lora_request=...), the max_loras slot rule, per-request errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmsched import LLM, LoRARequest, SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from support.hf_reference import hf_greedy
from support.lora import make_adapter, tiny_llama

pytest.importorskip("peft")

MAX_TOKENS = 6
ENGINE = {
    "dtype": "float32",
    "skip_tokenizer_init": True,
    "block_size": 4,
    "num_gpu_blocks_override": 128,
    "max_model_len": 64,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 64,
    "enable_lora": True,
    "max_lora_rank": 8,
}


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, list[LoRARequest], list]:
    """A tiny Llama, four adapters of ranks 2..8 and the merged references (index 0: base)."""
    root = tmp_path_factory.mktemp("llm_lora")
    base = tiny_llama(root / "base", seed=3)
    loras, refs = [], [base]
    for k, rank in enumerate((2, 4, 8, 4), start=1):
        refs.append(make_adapter(base, root / f"a{k}", rank=rank, alpha=2 * rank, seed=k))
        loras.append(LoRARequest(f"a{k}", k, str(root / f"a{k}")))
    return root / "base", base, loras, refs


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 320 for j in range(5 + i % 7)] for i in range(n)]


def test_max_loras_two_with_four_adapters(lora_model) -> None:
    path, _, loras, refs = lora_model
    engine = LLMEngine(EngineArgs(model=str(path), max_loras=2, **ENGINE))
    ps = prompts(12)
    which = [i % 5 for i in range(12)]  # 0: base, 1..4: adapters
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, (p, a) in enumerate(zip(ps, which)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp, lora_request=loras[a - 1] if a else None)
    done: dict[str, list[int]] = {}
    most = 0
    deferred = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if engine.last_step is not None:
            so = engine.last_step.scheduler_output
            in_step = {r.lora_id for r in so.scheduled if r.lora_id}
            most = max(most, len(in_step))
            deferred += any(r.lora_id and r.lora_id not in in_step for r in engine.scheduler.waiting)
    lm = engine.executor.lora
    engine.close()
    assert most == 2
    assert deferred > 0
    assert lm.num_evictions > 0
    assert len(done) == 12
    for i, (p, a) in enumerate(zip(ps, which)):
        assert done[str(i)] == hf_greedy(refs[a], p, MAX_TOKENS), i


def test_generate_takes_one_or_a_list_and_fails_bad_adapters_alone(lora_model, tmp_path: Path) -> None:
    path, _, loras, refs = lora_model
    llm = LLM(str(path), max_loras=4, **ENGINE)
    ps = prompts(3)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    one = llm.generate([{"prompt_token_ids": p} for p in ps], sp, lora_request=loras[1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in one] == [hf_greedy(refs[2], p, MAX_TOKENS) for p in ps]
    big = tmp_path / "big"
    make_adapter(lora_model[1], big, rank=16, alpha=16)
    bad = [
        LoRARequest("missing", 7, str(tmp_path / "nowhere")),
        LoRARequest("big", 8, str(big)),
        None,
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, lora_request=bad, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "does not exist" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "error" and "max_lora_rank=8" in outs[1].error
    assert list(outs[2].outputs[0].token_ids) == hf_greedy(refs[0], ps[2], MAX_TOKENS)
    with pytest.raises(ValueError, match="2 LoRA requests for 3 prompts"):
        llm.generate([{"prompt_token_ids": p} for p in ps], sp, lora_request=loras[:2], use_tqdm=False)
    # One id, two different adapters: the second is refused.
    clash = LoRARequest("other", loras[1].lora_int_id, loras[0].lora_path)
    out = llm.generate({"prompt_token_ids": ps[0]}, sp, lora_request=clash, use_tqdm=False)[0]
    assert "already LoRA adapter 'a2'" in out.error
    llm.close()


def test_unload_refuses_an_adapter_in_use(lora_model) -> None:
    path, _, loras, _ = lora_model
    engine = LLMEngine(EngineArgs(model=str(path), max_loras=2, **ENGINE))
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("x", {"prompt_token_ids": [1, 2, 3]}, sp, lora_request=loras[0])
    assert engine.list_loras() == [1]
    with pytest.raises(ValueError, match="in use by 1 unfinished"):
        engine.remove_lora(1)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(1) is True
    assert engine.list_loras() == []
    assert engine.remove_lora(1) is False
    engine.close()


def test_lora_off_rejects_a_lora_request(lora_model) -> None:
    path, _, loras, _ = lora_model
    args = {**ENGINE, "enable_lora": False}
    engine = LLMEngine(EngineArgs(model=str(path), **args))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        engine.add_request("x", {"prompt_token_ids": [1, 2]}, None, lora_request=loras[0])
    assert engine.scheduler_config.max_loras is None
    engine.close()
    assert json.loads((Path(loras[0].lora_path) / "adapter_config.json").read_text())["r"] == 2


def test_lora_with_ngram_speculation_keeps_greedy_outputs(lora_model) -> None:
    # Verified drafts run the adapter on every row; greedy outputs stay each adapter's own.
    path, _, loras, refs = lora_model
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(model=str(path), max_loras=2, speculative_config=spec, **ENGINE)
    ps = [p * 3 for p in prompts(6)]  # repeats give the n-gram lookup drafts to verify
    which = [i % 3 for i in range(6)]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ps],
        sp,
        lora_request=[loras[a - 1] if a else None for a in which],
        use_tqdm=False,
    )
    stats = llm.llm_engine.spec_stats
    llm.close()
    assert stats is not None and stats.num_draft_tokens > 0
    for p, a, out in zip(ps, which, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(refs[a], p, MAX_TOKENS)


def test_an_offline_session_runs_every_turn_with_its_adapter(lora_model) -> None:
    path, _, loras, refs = lora_model
    llm = LLM(model=str(path), max_loras=1, **ENGINE)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first, second = prompts(2)
    try:
        with llm.session(sp, lora_request=loras[1]) as s:
            out1 = s.send({"prompt_token_ids": first}).outputs[0].token_ids
            out2 = s.send({"prompt_token_ids": second}).outputs[0].token_ids
    finally:
        llm.close()
    assert out1 == hf_greedy(refs[2], first, MAX_TOKENS)
    assert out2 == hf_greedy(refs[2], first + out1[:-1] + second, MAX_TOKENS)
    assert out1 != hf_greedy(refs[0], first, MAX_TOKENS)  # the adapter changes the output
