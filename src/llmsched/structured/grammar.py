"""Turning a StructuredOutputsParams into an xgrammar Grammar, naming what is wrong with bad input."""

from __future__ import annotations

import json
import re
from typing import Any

from llmsched.core.errors import InvalidSamplingParams
from llmsched.core.structured_params import StructuredOutputsParams

# xgrammar prefixes its messages with a time and a C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class InvalidStructuredOutput(InvalidSamplingParams):
    """A JSON schema, regex, choice list or grammar cannot be used; the message names it."""


def _clean(e: BaseException) -> str:
    return _LOCATION.sub("", str(e).strip()).strip()


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidSamplingParams(
            "structured outputs need xgrammar: pip install 'llmsched[structured]'"
        ) from None
    return xgrammar


def load_schema(value: str | dict) -> dict:
    """The schema as a dict; text must parse as JSON and the result be a valid JSON schema."""
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidStructuredOutput(f"structured_outputs.json is not valid JSON: {e}") from None
    else:
        schema = value
    if not isinstance(schema, (dict, bool)):
        raise InvalidStructuredOutput("structured_outputs.json must be a JSON schema object")
    try:
        import jsonschema
    except ImportError:
        return schema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise InvalidStructuredOutput(
            f"structured_outputs.json is not a valid JSON schema at {where}: {e.message}"
        ) from None
    return schema


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``."""
    # json.dumps quotes and escapes as the EBNF string literal expects.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams, disable_any_whitespace: bool = False) -> Any:
    """The xgrammar Grammar for ``params``; raises InvalidStructuredOutput naming the bad field.

    JSON is compact (no whitespace between tokens) when the request or the
    engine (``disable_any_whitespace``) asks for it.
    """
    xgr = _xgr()
    kind = params.kind
    compact = params.disable_any_whitespace or disable_any_whitespace
    ws: dict[str, Any] = {"any_whitespace": not compact, "separators": (",", ":") if compact else None}
    try:
        if kind == "json":
            schema = load_schema(params.json)  # type: ignore[arg-type]
            if params.disable_additional_properties and isinstance(schema, dict):
                schema = _close_objects(schema)
            return xgr.Grammar.from_json_schema(json.dumps(schema), **ws)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **ws)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))  # type: ignore[arg-type]
        return xgr.Grammar.from_ebnf(params.grammar)
    except InvalidStructuredOutput:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidStructuredOutput(f"structured_outputs.{kind} is invalid: {_clean(e)}") from None


def _close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose objects without additionalProperties get it set to false."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
