"""Completions' echo with logprobs, prompt_logprobs on completions and chat (lm-eval's local-completions)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

BLOCK = 16
PROMPT = "The quick brown fox jumps over the lazy dog, " * 2


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def server(
    request: pytest.FixtureRequest, embedded_server: Callable[..., AbstractContextManager]
) -> Iterator[ServerThread]:
    """The embedded model, 16-token blocks, a 32-token budget (prompts run in several chunks)."""
    engine_args = EngineArgs(
        max_model_len=256,
        num_gpu_blocks_override=128,
        block_size=BLOCK,
        max_num_batched_tokens=32,
        async_scheduling=request.param,
        dtype="float32",
    )
    with embedded_server(engine_args, ServerArgs(log_level="warning", engine_mode="thread")) as s:
        yield s


def post(server: ServerThread, path: str, body: dict) -> dict:
    """One JSON POST that must succeed."""
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_max_tokens_0_with_logprobs_returns_the_prompt_and_its_logprobs(server: ServerThread) -> None:
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    out = post(server, "/v1/completions", body)
    c = out["choices"][0]
    assert c["text"] == PROMPT
    lp = c["logprobs"]
    # One entry per prompt token (the byte tokenizer: one per character); the first has none.
    assert len(lp["tokens"]) == len(PROMPT)
    assert "".join(lp["tokens"]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    for tok, own, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        # The prompt token itself is always listed, beside the most likely one.
        assert top[tok] == own
        assert max(top.values()) >= own
    assert lp["text_offset"] == list(range(len(PROMPT)))
    # vLLM counts the one token sampled (and not shown) as completion tokens.
    assert out["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 1,
        "total_tokens": len(PROMPT) + 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    second = plp[1][str(ord(PROMPT[1]))]
    assert second["logprob"] == lp["token_logprobs"][1]


def test_echo_logprobs_equal_the_generated_tokens_logprobs_of_the_same_text(server: ServerThread) -> None:
    """The prompt's logprobs agree with what sampling reports for the same positions (another path)."""
    head = PROMPT[:40]
    gen = post(
        server,
        "/v1/completions",
        {"prompt": head, "max_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True},
    )["choices"][0]
    text = head + gen["text"]
    echo = post(
        server,
        "/v1/completions",
        {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0},
    )["choices"][0]["logprobs"]
    got = echo["token_logprobs"][len(head) :]
    want = gen["logprobs"]["token_logprobs"]
    assert len(got) == len(want) == 12
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def test_echo_with_generation_puts_prompt_logprobs_before_the_generated_ones(server: ServerThread) -> None:
    body = {
        "prompt": PROMPT,
        "echo": True,
        "max_tokens": 3,
        "logprobs": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    c = post(server, "/v1/completions", body)["choices"][0]
    lp = c["logprobs"]
    assert c["text"].startswith(PROMPT) and len(c["text"]) == len(PROMPT) + 3
    assert len(lp["tokens"]) == len(PROMPT) + 3
    assert lp["token_logprobs"][0] is None
    # Greedy: each generated token is the most likely one.
    for own, top in zip(lp["token_logprobs"][-3:], lp["top_logprobs"][-3:]):
        assert own == max(top.values())


def test_echo_without_logprobs_and_max_tokens_0_returns_the_prompt_only(server: ServerThread) -> None:
    c = post(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0})["choices"][0]
    assert c["text"] == PROMPT
    assert c["logprobs"] is None
    assert c["finish_reason"] == "length"
    assert "prompt_logprobs" not in c


def test_streamed_echo_with_logprobs_sends_the_prompt_first(server: ServerThread) -> None:
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 2, "logprobs": 0, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert first["logprobs"]["tokens"][: len(PROMPT)] == list(PROMPT)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert "".join(e["choices"][0]["text"] for e in events).startswith(PROMPT)


def test_prompt_logprobs_extra_field_on_completions_and_chat(server: ServerThread) -> None:
    c = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 0}
    )["choices"][0]
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = plp[pos]
        own = entry[str(ord(PROMPT[pos]))]
        # The prompt token and the top 3 (it may be among them).
        assert 3 <= len(entry) <= 4
        assert sorted(v["rank"] for k, v in entry.items() if v["rank"] <= 3)[:3] == [1, 2, 3]
        assert own["rank"] >= 1
    assert c["logprobs"] is None
    chat = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(server: ServerThread) -> None:
    body = {"prompt": PROMPT + "again", "max_tokens": 1, "temperature": 0}
    post(server, "/v1/completions", body)
    warm = post(server, "/v1/completions", body)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    out = post(server, "/v1/completions", {**body, "prompt_logprobs": 0})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(e is not None for e in out["choices"][0]["prompt_logprobs"][1:])
