"""POST /tokenize and /detokenize, GET /version and GET/POST /ping, shaped as vLLM's, over real HTTP."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest

import llmsched
from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

MAX_LEN = 128


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model (a byte-level tokenizer with a chat template)."""
    args = ServerArgs(log_level="warning", engine_mode="thread")
    with embedded_server(EngineArgs(max_model_len=MAX_LEN, num_gpu_blocks_override=256), args) as s:
        yield s


def post(server: ServerThread, path: str, body: dict) -> httpx.Response:
    """One JSON POST."""
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_tokenize_a_prompt_returns_its_ids_count_and_the_context_length(server: ServerThread) -> None:
    r = post(server, "/tokenize", {"prompt": "héllo", "add_special_tokens": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len("héllo".encode())
    assert body["max_model_len"] == MAX_LEN
    assert body["token_strs"] is None
    back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "héllo"}


def test_tokenize_returns_token_strings_on_request(server: ServerThread) -> None:
    body = post(server, "/tokenize", {"prompt": "ab", "return_token_strs": True}).json()
    assert len(body["token_strs"]) == body["count"]
    assert all(isinstance(s, str) for s in body["token_strs"])


def test_tokenize_chat_messages_matches_what_the_chat_route_counts(server: ServerThread) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    tok = post(server, "/tokenize", {"messages": messages})
    assert tok.status_code == 200, tok.text
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == tok.json()["count"]
    text = post(server, "/detokenize", {"tokens": tok.json()["tokens"]}).json()["prompt"]
    assert "Say hi" in text
    without = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < tok.json()["count"]


def test_tokenize_chat_refuses_continue_with_a_generation_prompt(server: ServerThread) -> None:
    r = post(
        server,
        "/tokenize",
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "continue_final_message"


def test_detokenize_refuses_ids_outside_the_vocabulary(server: ServerThread) -> None:
    r = post(server, "/detokenize", {"tokens": [1, 10**9]})
    assert r.status_code == 400
    assert "not in the vocabulary" in r.json()["error"]["message"]


def test_tokenize_for_an_unknown_model_is_404(server: ServerThread) -> None:
    r = post(server, "/tokenize", {"model": "nope", "prompt": "x"})
    assert r.status_code == 404


def test_version_and_ping(server: ServerThread) -> None:
    assert httpx.get(server.base_url + "/version").json() == {"version": llmsched.__version__}
    assert httpx.get(server.base_url + "/ping").status_code == 200
    assert httpx.post(server.base_url + "/ping").status_code == 200


def test_chat_template_flag_replaces_the_models_template(
    embedded_server: Callable[..., AbstractContextManager], tmp_path
) -> None:
    # vLLM's --chat-template: a file (or the template's text) used for every chat request.
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    args = ServerArgs(log_level="warning", engine_mode="thread", chat_template=str(path))
    with embedded_server(EngineArgs(max_model_len=MAX_LEN, num_gpu_blocks_override=64), args) as s:
        r = post(s, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        # The embedded tokenizer is byte-level: the ids are the rendered text's bytes.
        assert bytes(r.json()["tokens"]).decode() == "[user] hi\n"
