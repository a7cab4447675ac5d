"""The grammar manager: validation on add, compilation on its worker, the cache by constraint text."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from llmsched.core.structured_params import StructuredOutputsParams
from llmsched.engine.tokenizer import load_tokenizer
from llmsched.structured.grammar import InvalidStructuredOutput, choice_ebnf
from llmsched.structured.manager import StructuredOutputManager
from llmsched.structured.matcher import new_matcher


@pytest.fixture
def manager(use_embedded: Path) -> StructuredOutputManager:
    tok = load_tokenizer(use_embedded)
    m = StructuredOutputManager(tok, 264, tok.eos_token_ids)
    yield m
    m.close()


def test_same_constraint_text_shares_one_compilation(manager: StructuredOutputManager) -> None:
    a = manager.grammar_for(StructuredOutputsParams(json={"type": "object", "required": []}))
    b = manager.grammar_for(StructuredOutputsParams(json={"required": [], "type": "object"}))
    assert a is b
    a.future.result(timeout=30)
    c = manager.grammar_for(StructuredOutputsParams(json='{"type":"object","required":[]}'))
    assert c is a
    assert manager.num_compiled == 1 and manager.num_cache_hits == 2


def test_compilation_runs_on_the_worker_and_reports_ready(manager: StructuredOutputManager) -> None:
    gate = threading.Event()
    manager.before_compile = lambda p: gate.wait(30)
    h = manager.grammar_for(StructuredOutputsParams(regex="[a-c]{2}"))
    assert not h.ready
    gate.set()
    h.future.result(timeout=30)
    assert h.ready and h.error is None
    m = new_matcher(h, [])
    for ch in b"ab":
        assert m.accept_token(ch)
    assert m.is_completed()


@pytest.mark.parametrize(
    ("so", "needle"),
    [
        (
            StructuredOutputsParams(json={"type": "objekt"}),
            "structured_outputs.json is not a valid JSON schema",
        ),
        (StructuredOutputsParams(json={"properties": {"a": {"minLength": "x"}}}), "properties/a/minLength"),
        (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex is invalid"),
        (StructuredOutputsParams(grammar="root ::= "), "structured_outputs.grammar is invalid"),
    ],
)
def test_bad_constraints_raise_on_the_spot(manager: StructuredOutputManager, so, needle: str) -> None:
    with pytest.raises(InvalidStructuredOutput, match=needle):
        manager.grammar_for(so)
    assert manager.num_compiled == 0


def test_choice_grammar_escapes_quotes_and_backslashes() -> None:
    assert choice_ebnf(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def test_a_model_without_eos_cannot_constrain(use_embedded: Path) -> None:
    with pytest.raises(InvalidStructuredOutput, match="end-of-sequence"):
        StructuredOutputManager(load_tokenizer(use_embedded), 264, [])
