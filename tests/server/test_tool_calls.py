"""Tool-call plans, the Hermes <tool_call> parser and the tool-call chat formatter (whole and streamed)."""

from __future__ import annotations

import json

import pytest

from llmsched.server.errors import APIError
from llmsched.server.responses import Delta
from llmsched.server.tool_calls import held_back, parse_hermes, plan_tools
from llmsched.server.tool_responses import ToolChatFormatter

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
G = {"type": "function", "function": {"name": "g"}}


def test_plans_for_each_tool_choice() -> None:
    assert plan_tools(None, None) is None
    assert plan_tools([F], None).mode == "auto"
    assert plan_tools([F], "none").mode == "none"
    req = plan_tools([F, G], "required")
    assert req.mode == "required" and req.schema["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in req.schema["items"]["anyOf"]] == [["f"], ["g"]]
    named = plan_tools([F, G], {"type": "function", "function": {"name": "g"}})
    # A function without parameters takes an empty object.
    assert (
        named.mode == "named" and named.name == "g" and named.schema == {"type": "object", "properties": {}}
    )


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (None, "required", "tool_choice"),
        ([{"type": "retrieval"}], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, "tools"),
        ([F], {"type": "function", "function": {"name": "zz"}}, "tool_choice"),
        ([F], "sometimes", "tool_choice"),
    ],
)
def test_bad_plans_are_400(tools: object, choice: object, param: str) -> None:
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice)  # type: ignore[arg-type]
    assert e.value.status == 400 and e.value.param == param


def test_hermes_blocks_become_calls_and_the_text_before_is_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g"}'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert calls[1]["function"]["arguments"] == "{}"
    assert parse_hermes("no calls here") == ("no calls here", [])
    # A block that is not a call leaves the whole text as content.
    assert parse_hermes("<tool_call>{oops</tool_call>") == ("<tool_call>{oops</tool_call>", [])


def test_held_back_covers_a_partial_tag_only() -> None:
    assert held_back("abc <tool_") == len("<tool_")
    assert held_back("abc <") == 1
    assert held_back("abc") == 0


def delta(text: str, finish: str | None = None) -> Delta:
    return Delta(text=text, token_ids=[1] * len(text), finish_reason=finish)


def stream(fmt: ToolChatFormatter, pieces: list[str]) -> list[dict]:
    out = []
    for i, p in enumerate(pieces):
        c = fmt.chunk(delta(p, "stop" if i == len(pieces) - 1 else None))
        if c is not None:
            out.append(c["choices"][0])
    return out


def test_auto_streams_content_then_the_calls_at_the_end() -> None:
    fmt = ToolChatFormatter("id", "m", 3, None, plan_tools([F], "auto"))
    pieces = ["Sure", ", <to", "ol_call>", '{"name": "f", "arguments": {"a": 2}}', "</tool_call>"]
    choices = stream(fmt, pieces)
    content = "".join(c["delta"].get("content", "") for c in choices)
    assert content == "Sure, "
    [last] = [c for c in choices if c["delta"].get("tool_calls")]
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "f"
    assert json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"]) == {"a": 2}


def test_auto_without_a_call_streams_all_text_including_a_held_tail() -> None:
    fmt = ToolChatFormatter("id", "m", 3, None, plan_tools([F], "auto"))
    choices = stream(fmt, ["a <", "b", " <"])
    assert "".join(c["delta"].get("content", "") for c in choices) == "a <b <"
    assert choices[-1]["finish_reason"] == "stop"


def test_whole_answers_for_auto_and_named() -> None:
    auto = ToolChatFormatter("id", "m", 3, None, plan_tools([F], "auto"))
    out = auto.final(delta('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "stop"))
    msg = out["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "f"
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    named = ToolChatFormatter(
        "id", "m", 3, None, plan_tools([F], {"type": "function", "function": {"name": "f"}})
    )
    out = named.final(delta('{"k": 1}', "stop"))
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"k": 1}'
    assert out["choices"][0]["finish_reason"] == "stop"
