"""Tool calls: the constraint each tool_choice implies, and turning generated text into OpenAI tool_calls.

tool_choice "required" constrains the output to a JSON array of
``{"name": ..., "parameters": {...}}`` objects, one of the tools each (the
parameters to that tool's schema); a named function constrains it to that
function's parameters. "auto" leaves the output free and reads calls the
model writes in the Hermes / Qwen format, one JSON object per block:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from llmsched.server.errors import APIError

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def new_call_id() -> str:
    """An id for one tool call (OpenAI's shape: call_ and 24 characters)."""
    return "call_" + secrets.token_hex(12)


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One entry of a message's tool_calls."""
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """Function name -> its parameters schema; 400 for a malformed tool."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[name] = params
    return out


@dataclass(slots=True)
class ToolPlan:
    """What a chat request's tools and tool_choice mean for generation and the answer.

    ``mode`` is "none" (tools ignored), "auto" (parse <tool_call> blocks),
    "required" (a constrained JSON array of calls) or "named" (one
    constrained call to ``name``). ``schema`` is the output's JSON schema for
    the constrained modes.
    """

    mode: str
    tools: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None
    schema: dict | None = None


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolPlan | None:
    """The ToolPlan for a request (None without tools); 400 for an inconsistent choice."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto", tools)
    if tool_choice == "none":
        return ToolPlan("none", tools)
    if tool_choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
            for name, params in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return ToolPlan("required", tools, schema=schema)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in functions:
            raise APIError(
                400, f"tool_choice names function {name!r}, which is not among the tools", "tool_choice"
            )
        return ToolPlan("named", tools, name=name, schema=functions[name])
    raise APIError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def parse_hermes(text: str) -> tuple[str, list[dict]]:
    """(content before the first <tool_call>, the calls) of a model's free-form answer.

    A block that is not a JSON object with a string "name" is left as content.
    """
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls = []
    for body in _BLOCK.findall(text[start:]):
        try:
            obj = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(tool_call(obj["name"], args if isinstance(args, str) else json.dumps(args)))
    return text[:start].rstrip(), calls


def calls_from_constrained(plan: ToolPlan, text: str) -> list[dict]:
    """The tool_calls of a constrained answer ("required": the array; "named": the arguments)."""
    if plan.mode == "named":
        return [tool_call(plan.name or "", text)]
    try:
        items = json.loads(text)
    except ValueError:
        # Cut by max_tokens: nothing parses, so no call is reported.
        return []
    return [tool_call(c["name"], json.dumps(c.get("parameters", {}))) for c in items if isinstance(c, dict)]


def held_back(text: str) -> int:
    """How many trailing characters of streamed ``text`` could start a <tool_call> tag."""
    for k in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-k:]):
            return k
    return 0
