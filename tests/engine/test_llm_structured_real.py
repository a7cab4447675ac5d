"""Structured outputs on a real model and its 49k-token byte-level vocabulary (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from llmsched import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "capital": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 2000},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "capital", "population_millions", "languages"],
}


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    engine = LLM(model=str(smollm2_gguf), max_model_len=512)
    yield engine
    engine.close()


def test_chat_answers_follow_the_schema(llm: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    messages = [{"role": "user", "content": "Describe France as JSON."}]
    params = [
        SamplingParams(max_tokens=200, temperature=0.7, seed=i, structured_outputs=so) for i in range(8)
    ]
    outs = llm.chat([messages] * 8, params, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_regex_and_choice_over_multi_byte_tokens(llm: LLM) -> None:
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    outs = llm.generate(
        ["Today's date is"] * 4,
        [
            SamplingParams(max_tokens=20, seed=i, structured_outputs=StructuredOutputsParams(regex=date))
            for i in range(4)
        ],
        use_tqdm=False,
    )
    for o in outs:
        assert re.fullmatch(date, o.outputs[0].text), o.outputs[0].text
    [o] = llm.generate(
        ["The sky is"],
        SamplingParams(
            max_tokens=8,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(choice=["blue", "green"]),
        ),
    )
    assert o.outputs[0].text in ("blue", "green")
