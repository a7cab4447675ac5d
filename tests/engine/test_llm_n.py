"""LLM.generate and LLM.chat with n > 1: n completions per prompt, sorted by index, in input order."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsched import LLM, SamplingParams

# Every test runs with the engine's scheduling in both modes.
pytestmark = pytest.mark.usefixtures("scheduling_mode")

PROMPT = "Once upon a time, in a land of paged attention, "


def make_llm(model_dir: Path, fake_factory, **kwargs: object) -> LLM:
    """An LLM over the byte-level test model and a FakeExecutor."""
    overrides = {k: kwargs.pop(k) for k in ("num_gpu_blocks", "max_model_len") if k in kwargs}
    return LLM(str(model_dir), executor_factory=fake_factory(**overrides), **kwargs)


@pytest.mark.parametrize("n", [2, 3])
def test_greedy_n_gives_n_identical_completions(byte_model_dir: Path, fake_factory, n: int) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    (out,) = llm.generate("abc", SamplingParams(n=n, max_tokens=4, temperature=0), use_tqdm=False)
    assert out.finished and out.request_id == "0"
    assert [c.index for c in out.outputs] == list(range(n))
    assert [c.text for c in out.outputs] == ["defg"] * n
    assert all(c.finish_reason == "length" and c.token_ids == list(b"defg") for c in out.outputs)
    assert out.prompt == "abc"
    assert not llm.llm_engine.has_unfinished_requests()


def test_mixed_n_keeps_input_order(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    prompts = ["abc", "xy", {"prompt_token_ids": [70, 71]}, "k"]
    params = [
        SamplingParams(n=3, max_tokens=5),
        SamplingParams(max_tokens=1),
        SamplingParams(n=2, max_tokens=2),
        SamplingParams(n=4, max_tokens=3),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 1, 2, 4]
    assert [[c.text for c in o.outputs] for o in outs] == [["defgh"] * 3, ["z"], ["HI"] * 2, ["lmn"] * 4]
    assert [[c.index for c in o.outputs] for o in outs] == [[0, 1, 2], [0], [0, 1], [0, 1, 2, 3]]
    assert [o.prompt for o in outs] == ["abc", "xy", None, "k"]
    assert all(o.finished for o in outs)
    assert len({o.request_id for o in outs}) == 4


def test_the_children_share_the_prompt_through_the_prefix_cache(byte_model_dir: Path, fake_factory) -> None:
    factory = fake_factory()
    llm = LLM(str(byte_model_dir), executor_factory=factory, block_size=16)
    assert len(PROMPT) == 48
    llm.generate(PROMPT, SamplingParams(n=3, max_tokens=2), use_tqdm=False)
    # One step admits all three; the later two find the first one's two full
    # blocks (the last prompt token is always computed) and compute the rest.
    assert factory.made[0].calls[0] == [("0_0", 48), ("1_0", 16), ("2_0", 16)]


def test_a_rejected_prompt_fails_with_n_error_completions(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory, max_model_len=32)
    outs = llm.generate(["y" * 40, "ab"], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    bad, good = outs
    assert bad.finished and bad.error is not None and "max_model_len is 32" in bad.error
    assert bad.error.startswith(f"request {bad.request_id!r}:")
    assert [(c.index, c.finish_reason) for c in bad.outputs] == [(0, "error"), (1, "error")]
    assert [c.text for c in good.outputs] == ["cd", "cd"]
    assert not llm.llm_engine.has_unfinished_requests()


def test_tqdm_counts_prompts_not_children(byte_model_dir: Path, fake_factory, capsys) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    llm.generate(["a", "b"], SamplingParams(n=3, max_tokens=2), use_tqdm=True)
    shown = capsys.readouterr().err
    assert "2/2" in shown and "6/" not in shown


def test_chat_with_n(byte_model_dir: Path, fake_factory) -> None:
    llm = make_llm(byte_model_dir, fake_factory)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    convs = [[{"role": "user", "content": "abc"}], [{"role": "user", "content": "k"}]]
    params = [SamplingParams(n=2, max_tokens=2), SamplingParams(max_tokens=3)]
    outs = llm.chat(convs, params, use_tqdm=False, chat_template=template)
    assert [o.prompt for o in outs] == ["abc", "k"]
    assert [[c.text for c in o.outputs] for o in outs] == [["de", "de"], ["lmn"]]


def test_seeded_sampling_gives_distinct_reproducible_completions(use_embedded: Path) -> None:
    llm = LLM()
    try:
        seeded = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=12, ignore_eos=True)
        (first,) = llm.generate(PROMPT, seeded, use_tqdm=False)
        texts = [c.token_ids for c in first.outputs]
        assert [c.index for c in first.outputs] == [0, 1, 2]
        assert all(len(t) == 12 for t in texts)
        assert len({tuple(t) for t in texts}) == 3, texts
        # Reproducible, also next to other prompts in the batch.
        again = llm.generate([PROMPT, "other"], [seeded, SamplingParams(max_tokens=3)], use_tqdm=False)
        assert [c.token_ids for c in again[0].outputs] == texts
        # Child i samples with seed + i, as vLLM: each equals an n=1 request with that seed.
        for i in range(3):
            one = SamplingParams(seed=11 + i, temperature=1.0, max_tokens=12, ignore_eos=True)
            (single,) = llm.generate(PROMPT, one, use_tqdm=False)
            assert single.outputs[0].token_ids == texts[i]
        # Greedy children are identical, and equal to the n=1 answer.
        greedy = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
        (g,) = llm.generate(PROMPT, greedy, use_tqdm=False)
        (g1,) = llm.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
        assert [c.token_ids for c in g.outputs] == [g1.outputs[0].token_ids] * 3
    finally:
        llm.close()
