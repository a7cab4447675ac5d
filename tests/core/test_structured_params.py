"""StructuredOutputsParams: exactly one constraint, types checked, errors naming the field."""

from __future__ import annotations

import pytest

from llmsched import SamplingParams, StructuredOutputsParams
from llmsched.core import InvalidSamplingParams


def test_each_kind_is_accepted_and_named() -> None:
    cases = {
        "json": {"json": {"type": "object"}},
        "regex": {"regex": "a+"},
        "choice": {"choice": ["x", "y"]},
        "grammar": {"grammar": 'root ::= "a"'},
        "json_object": {"json_object": True},
    }
    for kind, kw in cases.items():
        assert StructuredOutputsParams(**kw).kind == kind


def test_two_constraints_are_refused_naming_both() -> None:
    with pytest.raises(InvalidSamplingParams, match=r"only one kind of constraint.*json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")


def test_no_constraint_is_refused() -> None:
    with pytest.raises(InvalidSamplingParams, match="one constraint is required"):
        StructuredOutputsParams()


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"json": 5}, "structured_outputs.json"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"grammar": 3}, "structured_outputs.grammar"),
        ({"choice": "abc"}, "structured_outputs.choice"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"json_object": False}, "json_object"),
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
    ],
)
def test_bad_shapes_name_the_field(kw: dict, needle: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=needle):
        StructuredOutputsParams(**kw)


def test_key_is_the_constraint_text_independent_of_dict_order() -> None:
    a = StructuredOutputsParams(json={"type": "object", "required": []})
    b = StructuredOutputsParams(json={"required": [], "type": "object"})
    assert a.key() == b.key()
    assert a.key() != StructuredOutputsParams(json={"type": "array"}).key()
    assert (
        a.key()
        != StructuredOutputsParams(json={"type": "object", "required": []}, disable_any_whitespace=True).key()
    )


def test_sampling_params_take_an_object_or_a_dict() -> None:
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    assert p.structured_outputs.regex == "[0-9]+"
    with pytest.raises(InvalidSamplingParams, match="unknown field"):
        SamplingParams(structured_outputs={"regexp": "x"})
    with pytest.raises(InvalidSamplingParams, match="structured_outputs"):
        SamplingParams(structured_outputs="json")
