"""Offline streaming-input sessions (``LLM.session``) on the embedded random-weights model."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsched.core import RequestRejected, SamplingParams
from llmsched.engine.llm import LLM
from llmsched.engine.llm_session import SessionClosedError

FIRST = list(range(40, 60))
SECOND = list(range(70, 80))
THIRD = list(range(90, 97))

pytestmark = pytest.mark.usefixtures("scheduling_mode")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture
def llm(use_embedded: Path) -> LLM:
    engine = LLM(model=None, num_gpu_blocks_override=64, max_model_len=128, block_size=16)
    yield engine
    engine.close()


def free_blocks(llm: LLM) -> int:
    return llm.llm_engine.scheduler.kv.num_free_blocks


def single(llm: LLM, ids: list[int], max_tokens: int) -> list[int]:
    (out,) = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens), use_tqdm=False)
    return out.outputs[0].token_ids


def test_turns_match_one_request_on_the_history_and_close_frees_the_blocks(llm: LLM) -> None:
    free0 = free_blocks(llm)
    with llm.session(greedy(5)) as s:
        t1 = s.send({"prompt_token_ids": FIRST})
        out1 = t1.outputs[0].token_ids
        assert len(out1) == 5 and t1.outputs[0].finish_reason == "length"
        assert t1.turn_finished and not t1.finished and t1.prompt_token_ids == FIRST
        assert free_blocks(llm) < free0  # the session keeps its KV between turns
        t2 = s.send({"prompt_token_ids": SECOND}, greedy(4))
        out2 = t2.outputs[0].token_ids
        assert len(out2) == 4  # only this turn's tokens
        history = FIRST + out1[:-1] + SECOND
        assert t2.prompt_token_ids == history
        t3 = s.send({"prompt_token_ids": THIRD})  # back to the session's params
        history2 = history + out2[:-1] + THIRD
        assert len(t3.outputs[0].token_ids) == 5
    assert s.closed and free_blocks(llm) == free0
    assert single(llm, FIRST, 5) == out1
    assert single(llm, history, 4) == out2
    assert single(llm, history2, 5) == t3.outputs[0].token_ids
    assert free_blocks(llm) == free0


def test_text_turns_carry_their_text(llm: LLM) -> None:
    s = llm.session(greedy(3))
    t1 = s.send("hello")
    assert t1.prompt == "hello" and t1.prompt_token_ids == list(b"hello")
    t2 = s.send(" world")
    assert t2.prompt == "hello world"  # the session's input text so far
    assert t2.prompt_token_ids == list(b"hello") + t1.outputs[0].token_ids[:-1] + list(b" world")
    assert len(t2.outputs[0].text) > 0
    final = s.close()
    assert final is not None and final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].token_ids == []  # every token came with its turn


def test_interleaved_sessions_keep_their_own_histories(llm: LLM) -> None:
    free0 = free_blocks(llm)
    a, b = llm.session(greedy(3)), llm.session(greedy(3))
    assert a.request_id != b.request_id
    a1 = a.send({"prompt_token_ids": FIRST}).outputs[0].token_ids
    b1 = b.send({"prompt_token_ids": SECOND}).outputs[0].token_ids
    a2 = a.send({"prompt_token_ids": THIRD}).outputs[0].token_ids
    b2 = b.send({"prompt_token_ids": THIRD}).outputs[0].token_ids
    # generate() runs beside open sessions.
    assert single(llm, FIRST + a1[:-1] + THIRD, 3) == a2
    a.close()
    assert free_blocks(llm) < free0  # b still holds its blocks
    b.close()
    assert free_blocks(llm) == free0
    assert single(llm, SECOND + b1[:-1] + THIRD, 3) == b2


def test_errors_are_clear_and_leave_the_session_usable(llm: LLM) -> None:
    free0 = free_blocks(llm)
    with pytest.raises(RequestRejected, match="stop strings"):
        llm.session(SamplingParams(stop=["."])).send("hi")
    s = llm.session(greedy(2))
    with pytest.raises(RequestRejected, match=r"max_model_len is 128"):
        s.send({"prompt_token_ids": [5] * 130})
    t1 = s.send({"prompt_token_ids": FIRST})  # the refused first input opened nothing
    assert t1.prompt_token_ids == FIRST
    with pytest.raises(RequestRejected, match=r"session '.*'.*max_model_len is 128"):
        s.send({"prompt_token_ids": [5] * 110})
    t2 = s.send({"prompt_token_ids": SECOND})
    assert t2.prompt_token_ids == FIRST + t1.outputs[0].token_ids[:-1] + SECOND
    s.close()
    assert s.close() is None  # closing twice is harmless
    with pytest.raises(SessionClosedError, match="was closed"):
        s.send("more")
    with pytest.raises(ValueError, match="enable_lora"):
        llm.session(lora_request=object())  # type: ignore[arg-type]
    assert free_blocks(llm) == free0


def test_a_turn_stops_at_max_model_len_and_later_inputs_are_refused(llm: LLM) -> None:
    free0 = free_blocks(llm)
    s = llm.session(greedy(50))
    out = s.send({"prompt_token_ids": [7] * 100})
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 28
    with pytest.raises(RequestRejected, match="max_model_len is 128"):
        s.send({"prompt_token_ids": [8]})
    assert not s.closed and free_blocks(llm) < free0
    final = s.close()
    assert final is not None and final.finished and final.outputs[0].finish_reason == "length"
    assert free_blocks(llm) == free0


def test_an_interrupted_turn_aborts_the_session(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    free0 = free_blocks(llm)
    s = llm.session(greedy(8))
    s.send({"prompt_token_ids": FIRST})
    engine = llm.llm_engine
    real_step = engine.step
    calls = iter(range(100))

    def interrupted_step():
        if next(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        s.send({"prompt_token_ids": SECOND})
    monkeypatch.setattr(engine, "step", real_step)
    assert s.closed
    with pytest.raises(SessionClosedError, match="has ended"):
        s.send("x")
    for _ in range(3):
        engine.step()
    assert free_blocks(llm) == free0 and not engine.has_unfinished_requests()


def test_a_turn_that_cannot_get_blocks_fails_at_once_instead_of_hanging(use_embedded: Path) -> None:
    llm = LLM(model=None, num_gpu_blocks_override=10, max_model_len=128, block_size=16)
    try:
        kv = llm.llm_engine.scheduler.kv
        a = llm.session(greedy(4))
        a.send({"prompt_token_ids": [7] * 100})  # holds 7 of the 9 usable blocks between turns
        free = kv.num_free_blocks
        b = llm.session(greedy(4))
        with pytest.raises(
            RuntimeError, match=r"cannot be scheduled: 2 KV blocks are free.*other open sessions"
        ):
            b.send({"prompt_token_ids": [8] * 60})
        assert b.closed and kv.num_free_blocks == free
        a.close()
        # With a's blocks back, the same input runs.
        with llm.session(greedy(4)) as c:
            assert len(c.send({"prompt_token_ids": [8] * 60}).outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_generate_blocked_by_open_sessions_fails_those_requests_not_hangs(use_embedded: Path) -> None:
    llm = LLM(model=None, num_gpu_blocks_override=10, max_model_len=128, block_size=16)
    try:
        kv = llm.llm_engine.scheduler.kv
        a = llm.session(greedy(4))
        a.send({"prompt_token_ids": [7] * 100})  # holds 7 of the 9 usable blocks between turns
        free = kv.num_free_blocks
        small, large = {"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [8] * 60}
        outs = llm.generate([small, large], greedy(4), use_tqdm=False)
        # The small prompt fits beside the session; the large one waits for blocks only a.close() frees.
        assert len(outs[0].outputs[0].token_ids) == 4 and outs[0].error is None
        assert outs[1].error is not None and "open session(s) waiting for input" in outs[1].error
        assert kv.num_free_blocks == free and not a.closed
        a.close()
        assert len(llm.generate([large], greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        llm.close()
