"""skip_tokenizer_init: token ids in, token ids out, a clear error for text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from llmsched.core.errors import RequestRejected
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.llm import LLM


def test_token_ids_in_token_ids_out_with_no_tokenizer(byte_model_dir: Path, fake_factory: Callable) -> None:
    with_tok = LLM(str(byte_model_dir), executor_factory=fake_factory())
    without = LLM(str(byte_model_dir), executor_factory=fake_factory(), skip_tokenizer_init=True)
    assert without.get_tokenizer() is None
    prompt = {"prompt_token_ids": [72, 105, 33]}
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1)
    a = with_tok.generate([prompt], params, use_tqdm=False)[0]
    b = without.generate([prompt], params, use_tqdm=False)[0]
    assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(a.outputs[0].token_ids) == 5
    assert a.outputs[0].text and b.outputs[0].text == ""
    # Logprobs come with no decoded text.
    assert all(lp.decoded_token is None for entry in b.outputs[0].logprobs for lp in entry.values())


def test_text_prompts_stop_strings_and_chat_are_refused_by_name(
    byte_model_dir: Path, fake_factory: Callable
) -> None:
    llm = LLM(str(byte_model_dir), executor_factory=fake_factory(), skip_tokenizer_init=True)
    with pytest.raises(RequestRejected, match="skip_tokenizer_init"):
        llm.llm_engine.add_request("t", "hello")
    with pytest.raises(RequestRejected, match="stop strings need a tokenizer"):
        llm.llm_engine.add_request("s", {"prompt_token_ids": [1, 2]}, SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    # Nothing was left queued by the refusals.
    assert not llm.llm_engine.has_unfinished_requests()
