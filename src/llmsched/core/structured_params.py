"""StructuredOutputsParams: one output constraint (JSON schema, regex, choice, grammar or any JSON).

Shaped as vLLM 0.33 shapes it. Only the shape is checked here (exactly one
constraint, the right types); whether a schema, regex or grammar is valid
is decided when the engine builds its grammar, which names the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmsched.core.errors import InvalidSamplingParams

CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _canonical_json(value: str | dict) -> str:
    """One text per schema, whatever its key order or spacing (text that does not parse stays as is)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema, dict or text), ``regex``, ``choice``,
    ``grammar`` (EBNF) or ``json_object=True`` (any JSON object)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidSamplingParams(
                f"structured_outputs: only one kind of constraint may be given, got {', '.join(given)}"
            )
        if not given:
            raise InvalidSamplingParams(
                "structured_outputs: one constraint is required (json, regex, choice, grammar or json_object)"
            )
        if self.structural_tag is not None:
            raise InvalidSamplingParams("structured_outputs: structural_tag is not supported")
        if self.whitespace_pattern is not None:
            raise InvalidSamplingParams("structured_outputs: whitespace_pattern is not supported")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidSamplingParams(
                f"structured_outputs.json must be a JSON schema (an object or its text), "
                f"not {type(self.json).__name__}"
            )
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidSamplingParams(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)):
                raise InvalidSamplingParams("structured_outputs.choice must be a list of strings")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidSamplingParams(
                    "structured_outputs.choice must be a non-empty list of non-empty strings"
                )
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise InvalidSamplingParams("structured_outputs.json_object must be true when given")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(f"structured_outputs.{name} must be true or false")

    @property
    def kind(self) -> str:
        """Which constraint this is: 'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        for name in CONSTRAINT_FIELDS:
            if getattr(self, name) is not None:
                return name
        raise AssertionError("validated on construction")

    def key(self) -> tuple[str, str, bool, bool]:
        """The constraint as text: what compiled grammars are cached by."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            text = _canonical_json(value)
        elif kind == "choice":
            text = json.dumps(value)
        else:
            text = str(value)
        return kind, text, self.disable_any_whitespace, self.disable_additional_properties

    @classmethod
    def from_dict(cls, d: object) -> StructuredOutputsParams:
        """Build from a JSON request body's ``structured_outputs`` object (unknown keys refused)."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise InvalidSamplingParams("structured_outputs must be an object")
        allowed = {
            "json", "regex", "choice", "grammar", "json_object", "structural_tag",
            "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
        }  # fmt: skip
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise InvalidSamplingParams(f"structured_outputs: unknown field(s) {', '.join(unknown)}")
        return cls(**d)
