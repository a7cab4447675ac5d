"""SamplingParams validation: every field's range, the error type, and the field named in the message."""

from __future__ import annotations

import math
from typing import Any

import pytest

from llmsched.core.errors import InvalidSamplingParams
from llmsched.core.sampling_params import MAX_LOGPROBS, SamplingParams


def make(**fields: Any) -> SamplingParams:
    """Build SamplingParams from keyword fields (helper for parametrized cases)."""
    return SamplingParams(**fields)


INVALID: list[tuple[str, Any]] = [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("max_tokens", "8"),
    ("max_tokens", None),
    ("temperature", -0.01),
    ("temperature", -1),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", "1.0"),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", 2),
    ("top_p", math.nan),
    ("top_p", "0.5"),
    ("top_k", -2),
    ("top_k", -100),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_k", "5"),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("min_p", "0.1"),
    ("min_tokens", -1),
    ("min_tokens", 0.5),
    ("min_tokens", True),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, 2, -3]),
    ("stop_token_ids", ["7"]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", b"\x01"),
    ("stop", [""]),
    ("stop", ["ok", ""]),
    ("stop", [3]),
    ("stop", ["ok", None]),
    ("stop", ""),
    ("seed", 1.5),
    ("seed", "42"),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.01),
    ("presence_penalty", "0"),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", 3),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 2.0),
    ("logprobs", True),
    ("n", 0),
    ("n", -2),
    ("n", 1.0),
    ("n", True),
    ("n", "2"),
    ("n", None),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_rejected_naming_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidSamplingParams) as exc_info:
        make(**{field: value})
    assert field in str(exc_info.value)


def test_invalid_sampling_params_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_min_tokens_above_max_tokens_names_both() -> None:
    with pytest.raises(InvalidSamplingParams) as exc_info:
        SamplingParams(max_tokens=4, min_tokens=5)
    msg = str(exc_info.value)
    assert "min_tokens" in msg
    assert "max_tokens" in msg


def test_min_tokens_equal_to_max_tokens_accepted() -> None:
    p = SamplingParams(max_tokens=4, min_tokens=4)
    assert p.min_tokens == p.max_tokens == 4


VALID: list[tuple[str, Any]] = [
    ("max_tokens", 1),
    ("max_tokens", 100_000),
    ("temperature", 0),
    ("temperature", 0.0),
    ("temperature", 0.7),
    ("temperature", 5.0),
    ("top_p", 1.0),
    ("top_p", 1),
    ("top_p", 1e-6),
    ("top_p", 0.9),
    ("top_k", 0),
    ("top_k", -1),
    ("top_k", 1),
    ("top_k", 50),
    ("min_p", 0.0),
    ("min_p", 0.05),
    ("min_p", 1.0),
    ("min_tokens", 0),
    ("min_tokens", 3),
    ("stop_token_ids", []),
    ("stop_token_ids", [0]),
    ("stop_token_ids", [2, 7, 128001]),
    ("stop", ["\n\n"]),
    ("stop", ["a", "bc"]),
    ("seed", None),
    ("seed", 0),
    ("seed", 2**40),
    ("seed", -7),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -2),
    ("frequency_penalty", 2),
    ("repetition_penalty", 1.0),
    ("repetition_penalty", 0.5),
    ("repetition_penalty", 1.3),
    ("logprobs", None),
    ("logprobs", 0),
    ("logprobs", 5),
    ("logprobs", MAX_LOGPROBS),
    ("n", 1),
    ("n", 2),
    ("n", 64),
]


@pytest.mark.parametrize(("field", "value"), VALID, ids=[f"{f}={v!r}" for f, v in VALID])
def test_valid_value_accepted_and_kept(field: str, value: Any) -> None:
    p = make(**{field: value})
    assert getattr(p, field) == value


def test_defaults_are_valid_and_match_vllm() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.min_tokens == 0
    assert p.stop_token_ids == []
    assert p.stop == []
    assert p.ignore_eos is False
    assert p.seed is None
    assert p.logprobs is None
    assert p.n == 1


def test_single_stop_string_becomes_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]


def test_none_stop_lists_become_empty() -> None:
    p = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    assert p.stop == []
    assert p.stop_token_ids == []


def test_stop_token_ids_tuple_becomes_list() -> None:
    p = SamplingParams(stop_token_ids=(3, 4))  # type: ignore[arg-type]
    assert p.stop_token_ids == [3, 4]
    assert isinstance(p.stop_token_ids, list)


def test_stop_lists_are_copied() -> None:
    ids = [5, 6]
    strings = ["x"]
    p = SamplingParams(stop_token_ids=ids, stop=strings)
    ids.append(7)
    strings.append("y")
    assert p.stop_token_ids == [5, 6]
    assert p.stop == ["x"]


def test_defaults_not_shared_between_instances() -> None:
    a = SamplingParams()
    b = SamplingParams()
    a.stop_token_ids.append(1)
    assert b.stop_token_ids == []


@pytest.mark.parametrize(
    ("fields", "greedy"),
    [
        ({}, False),
        ({"temperature": 0.0}, True),
        ({"temperature": 1e-6}, True),
        ({"temperature": 0.5}, False),
        ({"top_k": 1}, True),
        ({"top_k": 2}, False),
    ],
)
def test_greedy(fields: dict[str, Any], greedy: bool) -> None:
    assert make(**fields).greedy is greedy


def test_a_bad_n_says_what_n_must_be() -> None:
    with pytest.raises(InvalidSamplingParams, match=r"n=0 is invalid: must be an integer >= 1"):
        SamplingParams(n=0)
