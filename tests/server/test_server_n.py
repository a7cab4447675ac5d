"""n > 1 forks a request into sequences sharing the prompt's KV blocks; echo returns the prompt first."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

BLOCK = 16
# Upper bounds on waits only catch a hang: a loaded host may be slow, never this slow.
HANG_S = 60.0
PROMPT = "Once upon a time in a land of paged attention, " * 2
# Full blocks a cache hit can cover (never the last prompt token).
FULL_BLOCKS = (len(PROMPT) - 1) // BLOCK


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model with 16-token blocks."""
    engine_args = EngineArgs(max_model_len=256, num_gpu_blocks_override=128, block_size=BLOCK)
    with embedded_server(engine_args, ServerArgs(log_level="warning", engine_mode="thread")) as s:
        yield s


def post(server: ServerThread, path: str, body: dict) -> dict:
    """One JSON POST that must succeed."""
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def counter(server: ServerThread, name: str, label: str = "") -> float:
    """A sample's value from /metrics (the first whose labels contain ``label``)."""
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def test_n3_gives_three_distinct_seeded_choices_computing_the_prompt_once(server: ServerThread) -> None:
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    hits0 = counter(server, "vllm:prefix_cache_hits_total")
    n_count0 = counter(server, "vllm:request_params_n_count")
    out = post(server, "/v1/completions", body)
    hits = counter(server, "vllm:prefix_cache_hits_total") - hits0
    # The metrics count it as one request with n = 3.
    assert counter(server, "vllm:request_params_n_count") - n_count0 == 1
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    texts = [c["text"] for c in choices]
    assert len(set(texts)) == 3, texts
    assert out["usage"]["prompt_tokens"] == len(PROMPT)
    assert out["usage"]["completion_tokens"] == 36
    # The second and third sequence found the first one's full prompt blocks in the cache.
    assert FULL_BLOCKS == 5 and hits == 2 * FULL_BLOCKS * BLOCK
    # Seeded: the same request gives the same three choices, and sequence 0 is the n=1 answer.
    assert [c["text"] for c in post(server, "/v1/completions", body)["choices"]] == texts
    single = post(server, "/v1/completions", {**body, "n": 1})["choices"][0]["text"]
    assert single == texts[0]


def test_a_streamed_n3_interleaves_choices_that_match_the_unstreamed_ones(server: ServerThread) -> None:
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    whole = [c["text"] for c in post(server, "/v1/completions", body)["choices"]]
    texts = ["", "", ""]
    finishes = [None, None, None]
    usage = None
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=stream_body, timeout=60) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line)
        if chunk["choices"]:
            c = chunk["choices"][0]
            texts[c["index"]] += c["text"]
            finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]
        else:
            usage = chunk["usage"]
    assert texts == whole and finishes == ["length"] * 3
    assert usage == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 30,
        "total_tokens": len(PROMPT) + 30,
        # The unstreamed run left the prompt's blocks in the cache.
        "prompt_tokens_details": {"cached_tokens": FULL_BLOCKS * BLOCK},
    }


def test_chat_with_n2_returns_two_messages(server: ServerThread) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "max_tokens": 5,
        "seed": 1,
        "temperature": 1,
    }
    out = post(server, "/v1/chat/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in out["choices"])


def test_echo_puts_the_prompt_before_the_completion(server: ServerThread) -> None:
    body = {"prompt": "abc", "max_tokens": 4, "echo": True, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/v1/completions", {**body, "echo": False})["choices"][0]["text"]
    assert post(server, "/v1/completions", body)["choices"][0]["text"] == "abc" + plain
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc" + plain
    assert chunks[0]["choices"][0]["text"].startswith("abc")
    # Token-id prompts echo their decoded text.
    ids = [104, 105]
    out = post(server, "/v1/completions", {**body, "prompt": ids})["choices"][0]["text"]
    assert out.startswith("hi")


def kv_blocks(server: ServerThread) -> tuple[float, float]:
    """(free, usable) KV blocks."""
    free = counter(server, "llmsched:kv_cache_free_blocks")
    return free, counter(server, "llmsched:kv_cache_usable_blocks")


def test_a_client_leaving_an_n3_stream_frees_every_sequence(server: ServerThread) -> None:
    body = {"prompt": "leave early", "n": 3, "max_tokens": 200, "ignore_eos": True, "stream": True}
    aborted = 'finished_reason="abort"'
    aborts0 = counter(server, "vllm:request_success_total", aborted)
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                break
    deadline = time.monotonic() + HANG_S
    while kv_blocks(server)[0] != kv_blocks(server)[1] or counter(server, "vllm:num_requests_running"):
        assert time.monotonic() < deadline, kv_blocks(server)
        time.sleep(0.05)
    # All three sequences were aborted, not left to run to max_tokens.
    assert counter(server, "vllm:request_success_total", aborted) - aborts0 == 3
