"""Every bad request gets an OpenAI-shaped 4xx naming the field, overload gets 503 with Retry-After."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model with a 64-token context."""
    with embedded_server(
        EngineArgs(max_model_len=64, num_gpu_blocks_override=256), ServerArgs(log_level="critical")
    ) as s:
        yield s


def assert_error(resp: httpx.Response, status: int, param: str | None = None, *words: str) -> dict:
    """The response is an OpenAI error with this status (and param, and words in the message)."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", ()),
        ({"prompt": "x", "temperature": "hot"}, "temperature", ()),
        ({"prompt": "x", "top_p": 0}, "top_p", ()),
        ({"prompt": "x", "logprobs": 21}, "logprobs", ()),
        ({"prompt": [1, 99999]}, "prompt", ("99999", "264")),
        ({"prompt": ""}, "prompt", ("empty",)),
        ({"prompt": ["a", "b"]}, "prompt", ("batched",)),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", ()),
        ({"prompt": "x", "stop": [""]}, "stop", ()),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", ()),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens", ()),
        ({"prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens", ("echo",)),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", ("20",)),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", ()),
        ({"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs", ()),
        ({"prompt": "x", "prompt_logprobs": "1"}, "prompt_logprobs", ()),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", ("stream",)),
        ({"prompt": "x", "logit_bias": {"1": 2.0}}, "logit_bias", ()),
        ({"prompt": "x", "seed": 2**70}, "seed", ()),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt", ()),
        ({"prompt": "x", "n": 129}, "n", ("n=129",)),
        ({"prompt": "x", "best_of": 2}, "best_of", ()),
        ({"prompt": "x", "repetition_penalty": 3.4e38}, "repetition_penalty", ()),
        ({"prompt": "x" * 70}, "prompt", ("64", "70")),
        ({"prompt": "x" * 10, "max_tokens": 60}, "max_tokens", ("60", "64", "10")),
        ({}, "prompt", ()),
    ],
)
def test_invalid_completion_requests_are_400_naming_the_field(
    server: ServerThread, body: dict, param: str, words: tuple[str, ...]
) -> None:
    assert_error(httpx.post(server.base_url + "/v1/completions", json=body), 400, param, *words)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": CHAT, "structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs"),
        ({"messages": [{"role": "user", "content": "y" * 80}]}, "messages"),
        ({"messages": CHAT, "max_completion_tokens": 500}, "max_completion_tokens"),
        ({"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ],
)
def test_invalid_chat_requests_are_400_naming_the_field(server: ServerThread, body: dict, param: str) -> None:
    assert_error(httpx.post(server.base_url + "/v1/chat/completions", json=body), 400, param)


def test_malformed_bodies_and_text_are_400(server: ServerThread) -> None:
    url = server.base_url + "/v1/completions"
    headers = {"content-type": "application/json"}
    assert_error(httpx.post(url, content=b"{not json", headers=headers), 400)
    assert_error(httpx.post(url, content=b"[1, 2]", headers=headers), 400)
    assert_error(httpx.post(url, content=b'{"prompt": "\\ud800"}', headers=headers), 400, "prompt")
    assert_error(httpx.post(url, content=b'{"prompt": "x", "temperature": NaN}', headers=headers), 400)


def test_unknown_routes_and_methods_keep_the_error_shape(server: ServerThread) -> None:
    assert_error(httpx.get(server.base_url + "/v1/nope"), 404)
    assert_error(httpx.get(server.base_url + "/v1/completions"), 405)
    assert_error(httpx.get(server.base_url + "/debug/steps?last=0"), 400, "last")


def test_the_server_still_answers_after_the_bad_requests(server: ServerThread) -> None:
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "ok", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_past_the_queue_limits_requests_get_503_with_retry_after(
    embedded_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
    # A long admission window holds accepted requests in flight, so the limits are reached
    # deterministically before anything finishes.
    args = ServerArgs(
        admission_window_ms=2500, max_num_queued_requests=3, max_num_queued_tokens=40, log_level="critical"
    )
    with ServerThread(EngineArgs(max_model_len=64, num_gpu_blocks_override=256), args) as server:
        url = server.base_url + "/v1/completions"
        statuses: list[int] = []

        def send(prompt_len: int) -> None:
            statuses.append(
                httpx.post(url, json={"prompt": [65] * prompt_len, "max_tokens": 2}, timeout=60).status_code
            )

        def in_flight(n: int) -> None:
            deadline = 100
            while server.state.engine.admission.num_requests < n and deadline:
                threading.Event().wait(0.02)
                deadline -= 1
            assert server.state.engine.admission.num_requests == n

        threads = []
        for prompt_len, n in ((30, 1), (4, 2), (4, 3)):
            t = threading.Thread(target=send, args=(prompt_len,))
            t.start()
            threads.append(t)
            in_flight(n)
        # 38 prompt tokens wait: 4 more fit the token limit, but 3 requests are in flight.
        full = httpx.post(url, json={"prompt": [65] * 2, "max_tokens": 2})
        err = assert_error(full, 503, None, "3 requests")
        assert full.headers["retry-after"] == "1" and err["type"] == "ServiceUnavailableError"
        for t in threads:
            t.join(60)
        assert statuses == [200, 200, 200]
        # Now the token limit: one 30-token prompt waits, a 20-token one would pass 40.
        t = threading.Thread(target=send, args=(30,))
        t.start()
        in_flight(1)
        tokens = httpx.post(url, json={"prompt": [65] * 20, "max_tokens": 2})
        assert_error(tokens, 503, None, "40")
        t.join(60)
        metrics = httpx.get(server.base_url + "/metrics").text
        assert (
            'vllm:admission_rejections_total{model_name="embedded-qwen3-v1",'
            'reason="max_num_queued_reqs"} 1.0' in metrics
        )
        assert 'reason="max_num_queued_tokens"} 1.0' in metrics
        assert httpx.post(url, json={"prompt": "fine", "max_tokens": 2}, timeout=60).status_code == 200


def test_a_dead_engine_process_turns_health_and_requests_into_503(
    embedded_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
    with ServerThread(
        EngineArgs(max_model_len=64, num_gpu_blocks_override=128), ServerArgs(log_level="critical")
    ) as server:
        url = server.base_url
        assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
        process = server.state.engine.backend.process  # type: ignore[attr-defined]
        process.kill()
        process.join(10)
        # The server notices when its loop does; the bound only catches a hang on a loaded host.
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code == 200 and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        assert_error(httpx.get(url + "/health"), 503, None, "engine")
        dead = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert_error(dead, 503, None, "engine")
        assert dead.headers["retry-after"] == "1"
        assert httpx.get(url + "/metrics").status_code == 200
