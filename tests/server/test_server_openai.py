"""A real server on 127.0.0.1 driven by the official openai client: completions, chat, streams, errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import openai
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

KEY = "sk-llmsched-test"
MODEL = "llmsched-test"


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model behind a real server with an API key and two served names."""
    engine_args = EngineArgs(max_model_len=256, num_gpu_blocks_override=1024, max_num_seqs=64)
    server_args = ServerArgs(api_key=KEY, served_model_name=[MODEL, "alias"], log_level="warning")
    with embedded_server(engine_args, server_args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    """The official client, pointed at the server."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_every_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "alias"]
    assert models.data[0].owned_by == "llmsched"
    assert models.data[0].model_extra["max_model_len"] == 256


def test_a_streamed_greedy_completion_equals_the_unstreamed_one_token_for_token(
    client: openai.OpenAI,
) -> None:
    kwargs = {"model": MODEL, "prompt": "The scheduler", "max_tokens": 24, "temperature": 0.0, "logprobs": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.prompt_tokens == len(b"The scheduler")
    assert len(choice.logprobs.tokens) == 24

    tokens: list[str] = []
    text = ""
    usage = None
    finish = None
    stream = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens.extend(c.logprobs.tokens)
            finish = c.finish_reason or finish
    assert tokens == choice.logprobs.tokens
    assert text == choice.text
    assert finish == "length"
    assert (
        usage is not None and usage.completion_tokens == 24 and usage.total_tokens == usage.prompt_tokens + 24
    )


def test_prompt_token_ids_and_a_served_alias(client: openai.OpenAI) -> None:
    out = client.completions.create(model="alias", prompt=[72, 105, 33], max_tokens=3, temperature=0.0)
    assert out.model == MODEL
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens <= 3
    assert out.id.startswith("cmpl-")


def test_chat_uses_the_models_template_and_streams_the_same_answer(
    client: openai.OpenAI, server: ServerThread
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.object == "chat.completion"
    # ChatML from the embedded model's tokenizer_config: the prompt is the rendered template.
    rendered = (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    tok = server.state.tokenizer
    assert full.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert full.usage.completion_tokens == 12

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_logprobs_report_the_top_alternatives(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_stop_strings_and_stop_token_ids_end_the_answer(client: openai.OpenAI) -> None:
    base = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True}
    ).choices[0]
    text = base.text
    stop = text[5:7]
    cut = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=16, temperature=0.0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop
    assert cut.text == text[: text.index(stop)]
    # The byte-level tokenizer: a character's id is its byte.
    stop_id = text.encode()[3]
    by_id = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=16, temperature=0.0, extra_body={"stop_token_ids": [stop_id]}
    ).choices[0]
    assert by_id.finish_reason == "stop" and by_id.model_extra["stop_reason"] == stop_id
    assert by_id.text == text[: text.encode().index(stop_id)]


def test_seeded_sampling_repeats_and_sampling_knobs_are_accepted(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL,
                prompt="seeded",
                max_tokens=24,
                temperature=1.5,
                top_p=0.95,
                seed=seed,
                extra_body={"top_k": 40, "min_p": 0.01, "ignore_eos": True},
            )
            .choices[0]
            .text
        )

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_cache_salt_separates_prefix_caches(client: openai.OpenAI) -> None:
    prompt = "a long shared prefix that fills several KV blocks " * 3
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    again = client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    other = client.completions.create(**kw, extra_body={"cache_salt": "tenant-b"})
    assert again.usage.prompt_tokens_details.cached_tokens >= 128
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_errors_reach_the_client_as_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert nf.value.body["type"] == "NotFoundError" and "gpt-4" in nf.value.body["message"]
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model=MODEL, prompt="y" * 300, max_tokens=1)
    message = long_prompt.value.body["message"]
    assert "256" in message and "300" in message
    assert long_prompt.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as n2:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=129)
    assert n2.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as temp:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert temp.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as prio:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 3})
    assert "priority" in prio.value.body["message"]


def test_the_api_key_guards_v1_but_not_health_or_metrics(server: ServerThread) -> None:
    wrong = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401
    assert e.value.body["type"] == "AuthenticationError" and e.value.body["code"] == 401
    raw = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"})
    assert raw.status_code == 401 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.base_url + "/debug/steps").status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    ok = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_the_thread_engine_mode_answers_like_the_process_mode(
    client: openai.OpenAI, embedded_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
    kwargs = {"prompt": "same engine, another home", "max_tokens": 12, "temperature": 0.0}
    expected = client.completions.create(model=MODEL, **kwargs).choices[0].text
    engine_args = EngineArgs(max_model_len=256, num_gpu_blocks_override=1024, max_num_seqs=64)
    with ServerThread(engine_args, ServerArgs(engine_mode="thread", log_level="warning")) as s:
        threaded = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert threaded.completions.create(model=None, **kwargs).choices[0].text == expected  # type: ignore[arg-type]
