"""Structured outputs through LLM.generate on the embedded random-weight model.

The model prefers nothing, so every constraint is the only reason its text
parses. Bounds in the schema (string lengths, number ranges, array sizes)
keep random completions finite: unbounded, this model repeats a digit or a
whitespace token until max_tokens. JSON is compact (the engine setting), for
the same reason.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest

from llmsched import LLM, SamplingParams, StructuredOutputsParams
from llmsched.core import Reason, RequestStatus

N = 100

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "pos": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -99, "maximum": 99},
                "ok": {"type": "boolean"},
            },
            "required": ["x", "ok"],
        },
    },
    "required": ["name", "age", "kind", "tags", "pos"],
}
REGEX = r"[A-Z]{2}-\d{3}(\.[a-z]{1,3})?"
CHOICES = ["red", "green", "blue", "light yellow"]
GRAMMAR = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""
EXPR = re.compile(r"^[0-9+\-()]+$")


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(embedded_cache: Path, request: pytest.FixtureRequest) -> LLM:
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
    engine = LLM(
        structured_outputs_disable_any_whitespace=True,
        max_num_seqs=128,
        seed=3,
        async_scheduling=request.param,
    )
    mp.undo()
    yield engine
    engine.close()


def generate(llm: LLM, so: StructuredOutputsParams, **kw: object) -> list[str]:
    kw = {"max_tokens": 160, "temperature": 1.0, **kw}
    params = [SamplingParams(seed=i, structured_outputs=so, **kw) for i in range(N)]
    outs = llm.generate(["Answer:"] * N, params, use_tqdm=False)
    for o in outs:
        # Ended by the grammar (EOS once complete), never cut by max_tokens.
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
    return [o.outputs[0].text for o in outs]


def test_json_schema_completions_validate(llm: LLM) -> None:
    texts = generate(llm, StructuredOutputsParams(json=SCHEMA))
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    # Sampled, not one answer a hundred times.
    assert len(set(texts)) > 10


def test_json_schema_as_text_and_top_p_top_k(llm: LLM) -> None:
    texts = generate(llm, StructuredOutputsParams(json=json.dumps(SCHEMA)), top_p=0.9, top_k=20)
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_greedy_completion_validates(llm: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    [out] = llm.generate(["x"], SamplingParams(max_tokens=160, temperature=0.0, structured_outputs=so))
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_json_object_is_an_object(llm: LLM) -> None:
    params = [
        SamplingParams(
            max_tokens=200,
            seed=i,
            structured_outputs=StructuredOutputsParams(json_object=True),
        )
        for i in range(20)
    ]
    outs = llm.generate(["{"] * 20, params, use_tqdm=False)
    # Unbounded (any object): those that ended must be objects; a random
    # model may run into max_tokens inside a long string.
    ended = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert ended
    for t in ended:
        assert isinstance(json.loads(t), dict)


def test_regex_completions_match(llm: LLM) -> None:
    texts = generate(llm, StructuredOutputsParams(regex=REGEX))
    for t in texts:
        assert re.fullmatch(REGEX, t), t
    assert len(set(texts)) > 10


def test_choice_completions_are_choices(llm: LLM) -> None:
    texts = generate(llm, StructuredOutputsParams(choice=CHOICES), temperature=2.0)
    assert set(texts) <= set(CHOICES)
    assert len(set(texts)) >= 2


def test_ebnf_grammar_completions_parse(llm: LLM) -> None:
    texts = generate(llm, StructuredOutputsParams(grammar=GRAMMAR))
    for t in texts:
        assert EXPR.match(t), t
        # A well-formed arithmetic expression: Python evaluates it.
        assert isinstance(eval(t, {"__builtins__": {}}), int), t
    assert len(set(texts)) > 10


def test_constrained_and_plain_requests_in_one_batch(llm: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(
            max_tokens=160, seed=i, structured_outputs=so if i % 2 else None, ignore_eos=i % 2 == 0
        )
        for i in range(16)
    ]
    outs = llm.generate(["Answer:"] * 16, params, use_tqdm=False)
    for i, o in enumerate(outs):
        if i % 2:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        else:
            assert len(o.outputs[0].token_ids) == 160


@pytest.mark.parametrize(
    ("so", "needle"),
    [
        (lambda: StructuredOutputsParams(json={"type": "objekt"}), "structured_outputs.json"),
        (lambda: StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (lambda: StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
        (lambda: StructuredOutputsParams(grammar='root ::= "a" |'), "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_fail_their_request_only(llm: LLM, so, needle: str) -> None:
    bad = SamplingParams(max_tokens=8, structured_outputs=so())
    good = SamplingParams(max_tokens=8, seed=1, ignore_eos=True)
    outs = llm.generate(["a", "b"], [bad, good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert needle in outs[0].error
    assert len(outs[1].outputs[0].token_ids) == 8
    assert llm.llm_engine.scheduler.kv.usage == 0.0


def test_slow_grammar_does_not_hold_back_the_requests_behind_it(llm: LLM) -> None:
    engine = llm.llm_engine
    manager = engine.structured_output_manager
    release = threading.Event()
    slow = StructuredOutputsParams(regex=r"slow-[0-9]{2}")
    manager.before_compile = lambda p: release.wait(30) if p.regex == slow.regex else None
    engine.scheduler.enable_trace()
    try:
        engine.add_request("slow", "Answer:", SamplingParams(max_tokens=16, seed=0, structured_outputs=slow))
        for i in range(3):
            engine.add_request(f"plain{i}", "Answer:", SamplingParams(max_tokens=4, ignore_eos=True))
        done: dict[str, object] = {}
        steps = 0
        while "plain0" not in done or "plain1" not in done or "plain2" not in done:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            steps += 1
            assert steps < 50
        # All plain requests finished while the grammar was still compiling.
        req = engine.scheduler.requests["slow"]
        assert req.status is RequestStatus.WAITING_FOR_GRAMMAR
        trace = engine.engine_core.last_scheduled.trace or engine.last_step.scheduler_output.trace
        assert any(e.request_id == "slow" and e.reason is Reason.GRAMMAR_COMPILING for e in trace.entries)
        release.set()
        req.grammar.future.result(timeout=30)
        while "slow" not in done:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            steps += 1
            assert steps < 200
        assert re.fullmatch(r"slow-[0-9]{2}", done["slow"].outputs[0].text)
    finally:
        release.set()
        manager.before_compile = None
        engine.scheduler.enable_trace(False)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_preempted_constrained_requests_resume_their_grammar(
    embedded_cache: Path, async_scheduling: bool
) -> None:
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
    small = LLM(
        structured_outputs_disable_any_whitespace=True,
        num_gpu_blocks_override=24,
        max_model_len=360,
        block_size=16,
        max_num_seqs=8,
        async_scheduling=async_scheduling,
    )
    mp.undo()
    try:
        so = StructuredOutputsParams(json=SCHEMA)
        params = [SamplingParams(max_tokens=300, seed=i, structured_outputs=so) for i in range(16)]
        outs = small.generate(["Answer in JSON:"] * 16, params, use_tqdm=False)
        assert small.llm_engine.scheduler.num_preemptions > 0
        for o in outs:
            assert o.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    finally:
        small.close()
