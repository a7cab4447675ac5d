"""Structured outputs with speculative decoding: greedy constrained outputs equal the non-speculative ones.

On the embedded random-weight model: prompt lookup drafts from a prompt of
valid answers (drafts the grammar often allows), and the model drafting
for itself proposes its unconstrained choice (drafts the grammar mostly
refuses, so each drafted row's own mask decides). Sampled requests are
checked to stay valid.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from llmsched import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
}
EXAMPLES = [
    '{"name":"ab","age":3,"kind":"cat","tags":["a"]}',
    '{"name":"x","age":40,"kind":"bird","tags":["b","c"]}',
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def generate(
    spec: dict | None, params: list[SamplingParams], prompts: list[str], async_scheduling: bool
) -> tuple[list[list[int]], list[str], int, int]:
    """Token ids, texts, and the drafts verified and accepted over the run."""
    llm = LLM(
        speculative_config=spec,
        async_scheduling=async_scheduling,
        structured_outputs_disable_any_whitespace=True,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        dtype="float32",
    )
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.spec_stats
        drafted = (stats.num_draft_tokens, stats.num_accepted_tokens) if stats is not None else (0, 0)
    finally:
        llm.close()
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs], *drafted


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_json_schema_greedy_equal_and_valid(use_embedded: Path, async_scheduling: bool, drafter: str) -> None:
    spec = NGRAM if drafter == "ngram" else {"model": str(use_embedded), "num_speculative_tokens": 3}
    so = StructuredOutputsParams(json=SCHEMA)
    prompts = [" ".join(EXAMPLES * 3) + " ", EXAMPLES[1] * 4, "Answer:", " ".join(EXAMPLES)]
    params = [SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=so, logprobs=1)] * 4
    off_ids, _, _, _ = generate(None, params, prompts, async_scheduling)
    on_ids, on_texts, drafts, accepted = generate(spec, params, prompts, async_scheduling)
    assert drafts > 0 and accepted > 0
    assert on_ids == off_ids
    for t in on_texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_sampled_json_schema_valid_with_drafts(use_embedded: Path) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    prompts = [" ".join(EXAMPLES * 3) + " "] * 8
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, structured_outputs=so) for i in range(8)]
    _, texts, drafts, _ = generate(NGRAM, params, prompts, async_scheduling=False)
    assert drafts > 0
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
