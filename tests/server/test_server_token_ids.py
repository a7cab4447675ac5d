"""--skip-tokenizer-init over HTTP: token-id prompts, token ids in every choice, 400 for text."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

PROMPT = [72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model without its tokenizer."""
    engine_args = EngineArgs(max_model_len=128, num_gpu_blocks_override=64, skip_tokenizer_init=True)
    with embedded_server(engine_args, ServerArgs(log_level="warning", engine_mode="thread")) as s:
        yield s


def post(server: ServerThread, path: str, body: dict) -> httpx.Response:
    """One JSON POST."""
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_a_token_id_prompt_returns_token_ids(server: ServerThread) -> None:
    r = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == ""
    assert len(choice["token_ids"]) == 6 and choice["prompt_token_ids"] == PROMPT
    # Streamed, the same ids arrive chunk by chunk, the prompt's once.
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": True}
    ids: list[int] = []
    prompts = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                ids.extend(c["token_ids"])
                if "prompt_token_ids" in c:
                    prompts.append(c["prompt_token_ids"])
    assert ids == choice["token_ids"] and prompts == [PROMPT]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "text"}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "stop": ["x"]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ],
)
def test_text_is_refused_with_a_clear_error(server: ServerThread, path: str, body: dict, param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and "--skip-tokenizer-init" in err["message"]


def test_tokenize_routes_say_there_is_no_tokenizer(server: ServerThread) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = post(server, path, body)
        assert r.status_code == 400 and "--skip-tokenizer-init" in r.json()["error"]["message"]
