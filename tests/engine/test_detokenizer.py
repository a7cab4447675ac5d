"""Incremental detokenisation: split UTF-8, context-dependent spaces, stop strings, hold-back."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer as FastTokenizer

from llmsched.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from llmsched.engine.stop_strings import find_stop_string, partial_stop_len
from llmsched.executor.torch.embedded import tokenizer_json


@pytest.fixture(scope="module")
def byte_tok() -> FastTokenizer:
    """The embedded model's byte-level BPE tokenizer: token id == byte value."""
    import json

    return FastTokenizer.from_str(json.dumps(tokenizer_json()))


def decoder(tok: FastTokenizer):
    """decode(ids) as the engine calls it."""
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def ids_of(text: str) -> list[int]:
    """Byte-level ids of ``text`` (one per UTF-8 byte)."""
    return list(text.encode("utf-8"))


def stream(det: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    """Feed ids one at a time; the text released after each."""
    out = []
    for t in ids:
        det.update([t])
        out.append(det.text)
    return out


def test_multibyte_characters_split_across_tokens_are_released_whole(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("hi "))
    texts = stream(det, ids_of("日本") + ids_of("!"))
    # 日 and 本 are three bytes each: nothing (no U+FFFD) until a character completes.
    assert texts == ["", "", "日", "日", "日", "日本", "日本!"]
    assert "\ufffd" not in "".join(texts)


def test_streamed_text_equals_full_decode_for_mixed_scripts(byte_tok: FastTokenizer) -> None:
    text = "naïve café → 😀 done, Ünïcödé ✓"
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("prompt"))
    stream(det, ids_of(text))
    assert det.text == text
    assert det.token_ids == ids_of(text)


def test_a_character_split_inside_the_prompt_boundary_is_not_garbled(byte_tok: FastTokenizer) -> None:
    # The prompt ends with an ordinary character; the output starts with a 4-byte emoji.
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("x"))
    texts = stream(det, ids_of("😀"))
    assert texts == ["", "", "", "😀"]


def test_context_dependent_spacing_matches_a_full_decode() -> None:
    # A SentencePiece-like decoder: words joined by spaces, so a token's text
    # depends on the one before it (the first word of the text has no space).
    vocab = ["the", "cat", "sat", "on", "mat"]

    def decode(ids: Sequence[int]) -> str:
        return " ".join(vocab[i] for i in ids)

    det = IncrementalDetokenizer(decode, [0, 1])
    stream(det, [2, 3, 0, 4])
    assert det.text == decode([0, 1, 2, 3, 0, 4])[len(decode([0, 1])) :] == " sat on the mat"


def test_invalid_utf8_is_released_after_the_pending_limit_and_at_finish(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("a"))
    # A lone lead byte followed by more lead bytes never completes a character.
    texts = stream(det, [0xE4] * (MAX_PENDING_TOKENS + 1))
    assert texts[0] == ""
    assert "\ufffd" in texts[-1]
    det2 = IncrementalDetokenizer(decoder(byte_tok), ids_of("a"))
    det2.update([0xE4])
    assert det2.text == ""
    det2.update([0xE6], finished=True)
    assert det2.text.endswith("\ufffd")


def test_stop_string_spanning_tokens_cuts_the_text_and_keeps_the_completing_token(
    byte_tok: FastTokenizer,
) -> None:
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("q"), stop=["END"])
    results = [det.update([t]) for t in ids_of("abEND")]
    assert results == [None, None, None, None, "END"]
    assert det.stop_string == "END"
    assert det.text == "ab"
    assert det.token_ids == ids_of("abEND")
    # Nothing more is taken once stopped.
    assert det.update(ids_of("zz")) is None
    assert det.token_ids == ids_of("abEND")


def test_include_stop_str_in_output_keeps_the_stop_string(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(
        decoder(byte_tok), ids_of("q"), stop=["END"], include_stop_str_in_output=True
    )
    stream(det, ids_of("abEND"))
    assert det.stop_string == "END"
    assert det.text == "abEND"


def test_tokens_after_the_stop_in_one_update_are_dropped(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("q"), stop=["xy"])
    assert det.update(ids_of("axyzw")) == "xy"
    assert det.token_ids == ids_of("axy")
    assert det.text == "a"


def test_the_earliest_stop_string_wins(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("q"), stop=["cd", "bcde"])
    assert det.update(ids_of("abcdef")) == "bcde"
    assert det.text == "a"


def test_stop_strings_inside_the_first_min_tokens_do_not_count(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("q"), stop=["a"], min_tokens=3)
    texts = stream(det, ids_of("aaxa"))
    assert det.stop_string == "a"
    # The first three tokens are protected; the fourth 'a' stops it.
    assert texts[2] == "aax"
    assert det.text == "aax"


def test_a_stop_string_straddling_the_min_tokens_boundary_counts(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("q"), stop=["xy"], min_tokens=2)
    stream(det, ids_of("axy"))
    assert det.stop_string == "xy"
    assert det.text == "a"


def test_eos_text_is_left_out_unless_stop_strings_are_included(byte_tok: FastTokenizer) -> None:
    # A stop token that is an ordinary byte ('!') shows whether its text is kept.
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("q"))
    det.update(ids_of("ok"))
    det.update(ids_of("!"), stop_terminated=True, finished=True)
    assert det.text == "ok"
    assert det.token_ids == ids_of("ok!")
    inc = IncrementalDetokenizer(decoder(byte_tok), ids_of("q"), include_stop_str_in_output=True)
    inc.update(ids_of("ok"))
    inc.update(ids_of("!"), stop_terminated=True, finished=True)
    assert inc.text == "ok!"


def test_streaming_holds_back_a_tail_that_may_become_a_stop_string(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("q"), stop=["STOP"])
    shown = []
    deltas = []
    for t in ids_of("abSTx"):
        det.update([t])
        shown.append(det.output_text(finished=False))
        deltas.append(det.delta_text(finished=False))
    assert shown == ["a", "ab", "ab", "ab", "abSTx"]
    assert deltas == ["a", "b", "", "", "STx"]
    det.update(ids_of("S"))
    assert det.output_text(finished=False) == "abSTx"
    # At the end nothing is held back.
    assert det.output_text(finished=True) == "abSTxS"
    assert det.delta_text(finished=True) == "S"


def test_held_back_text_is_never_shown_when_the_stop_string_completes(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(decoder(byte_tok), ids_of("q"), stop=["STOP"])
    deltas = []
    for t in ids_of("abSTOP"):
        det.update([t])
        deltas.append(det.delta_text(finished=det.stop_string is not None))
    assert "".join(deltas) == "ab"
    assert det.text == "ab"


def test_include_stop_str_means_no_hold_back(byte_tok: FastTokenizer) -> None:
    det = IncrementalDetokenizer(
        decoder(byte_tok), ids_of("q"), stop=["STOP"], include_stop_str_in_output=True
    )
    det.update(ids_of("abST"))
    assert det.output_text(finished=False) == "abST"


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [("abc", ["cd"], 1), ("abc", ["bcd", "c"], 2), ("abc", ["xyz"], 0), ("abc", ["abc"], 0), ("", ["a"], 0)],
)
def test_partial_stop_len(text: str, stops: list[str], expected: int) -> None:
    assert partial_stop_len(text, stops) == expected


def test_find_stop_string_only_reports_matches_ending_after_the_boundary() -> None:
    assert find_stop_string("abab", ["ab"], 0) == (0, "ab")
    # Matches wholly before the boundary were already checked.
    assert find_stop_string("abab", ["ab"], 2) == (2, "ab")
    assert find_stop_string("abab", ["ab"], 4) is None
