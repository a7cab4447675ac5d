"""Bad input never hurts other requests: body size, logprobs and stop limits, request timeouts."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

BODY_LIMIT = 64 * 1024
STEP_S = 0.01
# Upper bounds on waits only catch a hang: a loaded host may be slow, never this slow.
HANG_S = 60.0


class SlowExecutor:
    """The fake executor, one step every STEP_S seconds (so requests last long enough to overlap)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.num_gpu_blocks = inner.num_gpu_blocks  # type: ignore[attr-defined]
        self.max_model_len = inner.max_model_len  # type: ignore[attr-defined]

    def execute(self, so: object) -> object:
        """Sleep, then run the step."""
        time.sleep(STEP_S)
        return self.inner.execute(so)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def server(byte_model_dir: Path) -> Iterator[ServerThread]:
    """A slow fake engine with tight limits and a 1.5 s request timeout."""
    from conftest import FakeExecutor

    def factory(model: Path, **kwargs: object) -> SlowExecutor:
        merged = {k: v for k, v in kwargs.items() if v is not None}
        merged.update(num_gpu_blocks=256, max_model_len=1024)
        return SlowExecutor(FakeExecutor(model, **merged))  # type: ignore[arg-type]

    args = ServerArgs(
        log_level="warning",
        max_request_body_bytes=BODY_LIMIT,
        max_logprobs=5,
        max_stop_strings=4,
        max_stop_string_len=16,
        request_timeout_s=1.5,
    )
    engine_args = EngineArgs(model=str(byte_model_dir), max_model_len=1024)
    with ServerThread(engine_args, args, executor_factory=factory) as s:
        yield s


def post(server: ServerThread, path: str, **kwargs: object) -> httpx.Response:
    """One POST."""
    return httpx.post(server.base_url + path, timeout=60, **kwargs)  # type: ignore[arg-type]


def completion(server: ServerThread, prompt: str, n: int) -> dict:
    """A completion of exactly ``n`` tokens (well inside the timeout)."""
    r = post(server, "/v1/completions", json={"prompt": prompt, "max_tokens": n, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def alongside(server: ServerThread, attack: Callable[[], None]) -> None:
    """Run ``attack`` while four honest requests are in flight; they must come back whole and unchanged."""
    prompts = [f"honest {i}" for i in range(4)]
    expected = {p: completion(server, p, 20)["choices"][0]["text"] for p in prompts}
    got: dict[str, str] = {}

    def honest(p: str) -> None:
        got[p] = completion(server, p, 20)["choices"][0]["text"]

    threads = [threading.Thread(target=honest, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    attack()
    for t in threads:
        t.join(60)
    assert got == expected


def test_an_oversized_body_gets_413_without_hurting_others(server: ServerThread) -> None:
    big = json.dumps({"prompt": "x" * (2 * BODY_LIMIT), "max_tokens": 1}).encode()

    def attack() -> None:
        r = post(server, "/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert str(BODY_LIMIT) in r.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(big), 4096):
                yield big[i : i + 4096]

        # No Content-Length: read up to the limit, then refused.
        r = post(server, "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "PayloadTooLargeError"

    alongside(server, attack)
    # A body under the limit, chunked, is read whole as before.
    small = json.dumps({"prompt": "ok", "max_tokens": 2}).encode()
    r = post(
        server,
        "/v1/completions",
        content=iter([small[:5], small[5:]]),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text


def test_excessive_logprobs_and_stop_strings_get_400_naming_the_field(server: ServerThread) -> None:
    cases = [
        ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 6},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": "x" * 17}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ]

    def attack() -> None:
        for path, body, param in cases:
            r = post(server, path, json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, r.text

    alongside(server, attack)
    # At the limit is fine.
    r = post(server, "/v1/completions", json={"prompt": "a", "max_tokens": 2, "logprobs": 5, "stop": ["zz"]})
    assert r.status_code == 200, r.text


def free_blocks(server: ServerThread) -> tuple[float, float]:
    """(free, usable) KV blocks from /metrics."""
    text = httpx.get(server.base_url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith(("llmsched:kv_cache_free_blocks", "llmsched:kv_cache_usable_blocks")):
            values[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return values["llmsched:kv_cache_free_blocks"], values["llmsched:kv_cache_usable_blocks"]


def test_a_request_past_the_timeout_is_aborted_and_its_blocks_freed(server: ServerThread) -> None:
    body = {"prompt": "long", "max_tokens": 900, "ignore_eos": True}
    t0 = time.monotonic()
    r = post(server, "/v1/completions", json=body)
    assert r.status_code == 504, r.text
    assert "1.5 s" in r.json()["error"]["message"]
    # Not before the timeout; the 504 says it was the timeout that ended it.
    assert 1.4 < time.monotonic() - t0 < HANG_S
    events = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == 504
    # Both were aborted: the engine holds no request and no block.
    deadline = time.monotonic() + HANG_S
    while free_blocks(server)[0] != free_blocks(server)[1]:
        assert time.monotonic() < deadline, free_blocks(server)
        time.sleep(0.05)
    # And the server serves on.
    assert completion(server, "after", 3)["usage"]["completion_tokens"] == 3
