"""Chat with images (``image_url`` parts) through the server: data: URLs, refused URLs, 400s, metrics."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread
from support.tiny_llava import build_tiny_llava, image


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tiny_llava_server")
    build_tiny_llava(folder)
    engine_args = EngineArgs(
        model=str(folder), dtype="float32", max_model_len=256, block_size=8, limit_mm_per_prompt={"image": 2}
    )
    args = ServerArgs(served_model_name=["llava"], log_level="warning", engine_mode="thread")
    with ServerThread(engine_args, args) as s:
        yield s


def data_url(seed: int) -> str:
    buf = io.BytesIO()
    image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(s: ServerThread, parts: list[dict], **kw) -> httpx.Response:
    body = {"model": "llava", "messages": [{"role": "user", "content": parts}], "max_tokens": 4, **kw}
    return httpx.post(s.base_url + "/v1/chat/completions", json=body, timeout=60)


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def img(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_with_images_answers_and_counts_the_encoder_cache(server):
    r = chat(server, [text("what is"), img(data_url(1)), text("?")], temperature=0.0)
    assert r.status_code == 200, r.text
    plain = chat(server, [text("what is"), text("?")], temperature=0.0).json()["usage"]["prompt_tokens"]
    # One image fills 16 prompt positions (its placeholder text was 1 token).
    assert r.json()["usage"]["prompt_tokens"] == plain + 16 + 1
    assert r.json()["usage"]["completion_tokens"] == 4
    again = chat(server, [img(data_url(1)), img(data_url(2))], temperature=0.0)
    assert again.status_code == 200, again.text
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert "llmsched:encoder_cache_usage_perc" in metrics
    hits = next(line for line in metrics.splitlines() if line.startswith("llmsched:encoder_cache_hits"))
    encoded = next(
        line for line in metrics.splitlines() if line.startswith("llmsched:encoder_inputs_encoded")
    )
    # Image 1 was encoded once and found cached the second time.
    assert float(encoded.split()[-1]) == 2.0 and float(hits.split()[-1]) >= 1.0


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([img("https://example.com/cat.png")], "--allowed-media-domains"),
        ([img("data:image/png;base64,AAAA")], "cannot be decoded"),
        ([img("data:image/png;base64,not base64!")], "not valid base64"),
        ([img("ftp://example.com/cat.png")], "only data: and http(s)"),
        ([img(data_url(1)), img(data_url(2)), img(data_url(3))], "limit_mm_per_prompt allows 2"),
        ([{"type": "image_url"}], "needs a 'url'"),
    ],
    ids=["http_refused", "undecodable", "bad_base64", "other_scheme", "over_limit", "no_url"],
)
def test_bad_images_get_a_clear_400(server, parts, message):
    r = chat(server, parts)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    # The server keeps serving others.
    assert chat(server, [text("hi")]).status_code == 200


def test_more_images_than_placeholders_is_a_400(server):
    """A literal image token in the text makes the count of placeholders differ from the images."""
    r = chat(server, [text("<image> and"), img(data_url(1))])
    assert r.status_code == 400 and "image placeholder" in r.json()["error"]["message"]


def test_text_model_refuses_images(tmp_path: Path, embedded_server):
    with embedded_server(
        EngineArgs(max_model_len=128), ServerArgs(engine_mode="thread", log_level="warning")
    ) as s:
        body = {"messages": [{"role": "user", "content": [img(data_url(1))]}], "max_tokens": 2}
        r = httpx.post(s.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
