"""LLMEngine.add_request's per-request options the server needs: cache_salt and skip_special_tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsched.core import RequestRejected, SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.outputs import RequestOutput
from llmsched.executor.torch.embedded import IM_END_ID

# Every test runs with the engine's scheduling in both modes.
pytestmark = pytest.mark.usefixtures("scheduling_mode")


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle; the last output of each request."""
    last: dict[str, RequestOutput] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            last[out.request_id] = out
    return last


def test_cache_salt_keeps_prefix_cache_hits_within_the_salt(byte_model_dir: Path, fake_factory) -> None:
    engine = LLMEngine(EngineArgs(model=str(byte_model_dir)), executor_factory=fake_factory())
    prompt = list(b"a prompt long enough to fill three blocks of sixteen tokens each!!")
    p = SamplingParams(max_tokens=1)
    engine.add_request("first", prompt, p, cache_salt="alice")
    run(engine)
    engine.add_request("same-salt", prompt, p, cache_salt="alice")
    engine.add_request("other-salt", prompt, p, cache_salt="bob")
    engine.add_request("no-salt", prompt, p)
    outs = run(engine)
    assert outs["same-salt"].num_cached_tokens == 64
    assert outs["other-salt"].num_cached_tokens == 0
    assert outs["no-salt"].num_cached_tokens == 0
    with pytest.raises(RequestRejected, match="cache_salt"):
        engine.add_request("empty", prompt, p, cache_salt="")


def test_skip_special_tokens_is_per_request(byte_model_dir: Path, fake_factory) -> None:
    # The fake executor emits <|im_end|> then "!" for this prompt; min_tokens keeps EOS from stopping it.
    prompt = list(b"xyz")
    factory = fake_factory(scripts={tuple(prompt): [IM_END_ID, ord("!")]})
    engine = LLMEngine(EngineArgs(model=str(byte_model_dir)), executor_factory=factory)
    engine.add_request("skip", prompt, SamplingParams(max_tokens=2, min_tokens=2))
    engine.add_request("keep", prompt, SamplingParams(max_tokens=2, min_tokens=2, skip_special_tokens=False))
    outs = run(engine)
    assert outs["skip"].outputs[0].text == "!"
    assert outs["keep"].outputs[0].text == "<|im_end|>!"
