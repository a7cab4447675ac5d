"""Structured outputs and tool calls through a real server and the official openai client.

The embedded model has random weights: whatever parses below parses because
of the constraint. Schemas are bounded (see tests/engine/test_llm_structured.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import jsonschema
import openai
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

MODEL = "llmsched-test"
N = 100
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
        },
    },
    "required": ["city", "days", "unit", "hours", "where"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA},
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
        },
    },
}
BAD_SCHEMA = {"type": "objekt"}
MESSAGES = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    engine_args = EngineArgs(
        max_model_len=512,
        num_gpu_blocks_override=1024,
        max_num_seqs=128,
        structured_outputs_disable_any_whitespace=True,
    )
    with embedded_server(engine_args, ServerArgs(served_model_name=[MODEL], log_level="warning")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(server: ServerThread) -> Callable[[], openai.AsyncOpenAI]:
    """Makes an async client (one per event loop)."""
    return lambda: openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120
    )


def many(aclient: Callable[[], openai.AsyncOpenAI], max_tokens: int = 200, **kwargs: object) -> list:
    """N seeded chat completions sent at once (so they batch)."""
    import asyncio

    async def run() -> list:
        async with aclient() as c:
            calls = [
                c.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=max_tokens, seed=i, **kwargs
                )
                for i in range(N)
            ]
            return await asyncio.gather(*calls)

    return asyncio.run(run())


def test_response_format_json_schema_validates(aclient: Callable[[], openai.AsyncOpenAI]) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    for r in many(aclient, response_format=fmt):
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_response_format_json_object(client: openai.OpenAI) -> None:
    ended = 0
    for seed in range(10):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=200, seed=seed, response_format={"type": "json_object"}
        )
        if r.choices[0].finish_reason == "stop":
            ended += 1
            assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert ended


def test_structured_outputs_extra_body_regex_choice_grammar(
    aclient: Callable[[], openai.AsyncOpenAI],
) -> None:
    for so, check in (
        ({"regex": r"[a-z]{3}\d{2}"}, lambda t: re.fullmatch(r"[a-z]{3}\d{2}", t)),
        ({"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        (
            {"grammar": 'root ::= "x" [0-9] ("," "x" [0-9]){0,2}'},
            lambda t: re.fullmatch(r"x\d(,x\d){0,2}", t),
        ),
    ):
        for r in many(aclient, extra_body={"structured_outputs": so}):
            assert check(r.choices[0].message.content), (so, r.choices[0].message.content)


def test_completions_endpoint_takes_structured_outputs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="Answer:",
        max_tokens=200,
        seed=1,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_named_tool_choice_returns_a_valid_call(aclient: Callable[[], openai.AsyncOpenAI]) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for r in many(aclient, tools=[WEATHER, ALARM], tool_choice=choice):
        msg = r.choices[0].message
        [call] = msg.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_required_tool_choice_returns_calls_to_the_tools(aclient: Callable[[], openai.AsyncOpenAI]) -> None:
    schemas = {"get_weather": SCHEMA, "set_alarm": ALARM["function"]["parameters"]}
    names = set()
    # The array has no length limit (as vLLM builds it): room for several calls.
    for r in many(aclient, max_tokens=440, tools=[WEATHER, ALARM], tool_choice="required"):
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls"
        for c in calls:
            names.add(c.function.name)
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    assert names == set(schemas)


def test_streamed_named_tool_call_arguments_add_up(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "seed": 5, "tools": [WEATHER]}
    whole = client.chat.completions.create(**kwargs, tool_choice=choice)
    args, name, ids = "", None, set()
    for chunk in client.chat.completions.create(**kwargs, tool_choice=choice, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            assert tc.index == 0
            name = tc.function.name or name
            ids.add(tc.id) if tc.id else None
            args += tc.function.arguments or ""
    assert name == "get_weather" and len(ids) == 1
    assert args == whole.choices[0].message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(args), SCHEMA)


def test_streamed_required_tool_calls(client: openai.OpenAI) -> None:
    calls: dict[int, dict] = {}
    finish = None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        seed=2,
        tools=[ALARM],
        tool_choice="required",
        stream=True,
    )
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "args": ""})
            c["name"] += tc.function.name or ""
            c["args"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for c in calls.values():
        assert c["name"] == "set_alarm"
        assert 0 <= json.loads(c["args"])["hour"] <= 23


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
         "structured_outputs", "not a valid JSON schema"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs", "regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= "}}}, "structured_outputs", "grammar"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs",
         "only one kind of constraint"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
         "response_format", "only one output constraint"),
        ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "not among the tools"),
    ],
)  # fmt: skip
def test_bad_constraints_get_a_400_naming_the_problem(
    client: openai.OpenAI, kwargs: dict, param: str, needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kwargs)
    err = e.value.body
    assert needle in err["message"] and err["param"] == param
    # The server goes on serving.
    ok = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 4
