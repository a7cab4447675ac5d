"""Streaming-input sessions in LLMEngine on the embedded random-weights model: turns, KV, ends, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsched.core import RequestRejected, SamplingParams
from llmsched.core.request import RequestStatus
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.outputs import RequestOutput, RequestOutputKind

pytestmark = pytest.mark.usefixtures("scheduling_mode")

DELTA = RequestOutputKind.DELTA
FIRST = list(range(40, 60))
SECOND = list(range(70, 80))


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, fixed length: outputs depend only on the tokens before them."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(use_embedded: Path) -> LLMEngine:
    eng = LLMEngine(EngineArgs(model=None, num_gpu_blocks_override=64, max_model_len=128, block_size=16))
    yield eng
    eng.close()


def run_turn(engine: LLMEngine, rid: str = "s") -> tuple[list[RequestOutput], int]:
    """Step until the session's turn ends (or it finishes); its outputs and the tokens scheduled for it."""
    outs: list[RequestOutput] = []
    scheduled = 0
    for _ in range(500):
        for out in engine.step():
            assert out.request_id == rid
            outs.append(out)
        es = engine.last_step
        if es is not None:
            so = es.scheduler_output
            scheduled += sum(n for r, n in zip(so.scheduled, so.num_scheduled_tokens) if r.request_id == rid)
        if outs and outs[-1].turn_finished:
            return outs, scheduled
    raise AssertionError("the turn never ended")


def token_ids(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.outputs[0].token_ids]


def test_second_turn_keeps_the_kv_and_matches_one_request_on_the_whole_history(engine: LLMEngine) -> None:
    free0 = engine.scheduler.kv.num_free_blocks
    engine.add_request("s", {"prompt_token_ids": FIRST}, greedy(5), resumable=True, output_kind=DELTA)
    turn1, _ = run_turn(engine)
    assert [o.finished for o in turn1] == [False] * len(turn1)
    assert turn1[-1].outputs[0].finish_reason == "length" and turn1[-1].turn_finished
    assert not any(o.turn_finished for o in turn1[:-1])
    out1 = token_ids(turn1)
    assert len(out1) == 5
    # Between turns it holds its blocks and waits for input.
    assert engine.scheduler.requests["s"].status is RequestStatus.WAITING_FOR_INPUT
    assert engine.scheduler.kv.num_free_blocks < free0

    engine.add_request("s", {"prompt_token_ids": SECOND}, greedy(4), resumable=True)
    turn2, scheduled = run_turn(engine)
    out2 = token_ids(turn2)
    assert len(out2) == 4 and turn2[-1].outputs[0].finish_reason == "length"
    # Only the new input is prefilled, then one token per decode step.
    assert scheduled == len(SECOND) + len(out2) - 1
    assert engine.end_session("s")[0].finished
    assert engine.scheduler.kv.num_free_blocks == free0

    # The same history in one request: the turn's last sampled token is not part of it.
    history = FIRST + out1[:-1] + SECOND
    engine.add_request("r", {"prompt_token_ids": history}, greedy(4), output_kind=DELTA)
    single, _ = run_turn(engine, "r")
    assert token_ids(single) == out2
    assert engine.scheduler.kv.num_free_blocks == free0


def test_an_input_sent_during_a_turn_resumes_at_its_end_and_state_continues(engine: LLMEngine) -> None:
    free0 = engine.scheduler.kv.num_free_blocks
    engine.add_request("s", "hello", greedy(3), resumable=True)
    engine.add_request("s", " world", None, resumable=True)  # queued: the session's params carry on
    turn1, _ = run_turn(engine)
    # CUMULATIVE outputs run on across turns; each turn ends with its finish reason.
    assert len(turn1[-1].outputs[0].token_ids) == 3
    # Each turn reports its own prompt, though the next input was queued already.
    assert turn1[-1].prompt_token_ids == list(b"hello") and turn1[-1].prompt == "hello"
    turn2, _ = run_turn(engine)
    last = turn2[-1]
    assert last.outputs[0].finish_reason == "length" and not last.finished
    assert last.outputs[0].token_ids[:3] == turn1[-1].outputs[0].token_ids
    assert len(last.outputs[0].token_ids) == 6
    assert last.outputs[0].text.startswith(turn1[-1].outputs[0].text)
    assert last.prompt == "hello world"
    out1 = turn1[-1].outputs[0].token_ids
    assert last.prompt_token_ids == list(b"hello") + out1[:-1] + list(b" world")
    assert last.metrics is not None and last.metrics.num_generation_tokens == 6
    # Ending the input between turns finishes it at once, blocks freed.
    final = engine.end_session("s")
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].finish_reason == "length"
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == free0


def test_ending_the_input_during_a_turn_finishes_the_session_with_that_turn(engine: LLMEngine) -> None:
    free0 = engine.scheduler.kv.num_free_blocks
    engine.add_request("s", {"prompt_token_ids": FIRST}, greedy(4), resumable=True, output_kind=DELTA)
    first = engine.step()
    assert engine.end_session("s") == []
    outs, _ = run_turn(engine)
    outs = first + outs
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert len(token_ids(outs)) == 4
    for _ in range(3):
        engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == free0


def test_a_non_resumable_request_with_the_id_ends_the_input(engine: LLMEngine) -> None:
    free0 = engine.scheduler.kv.num_free_blocks
    engine.add_request("s", {"prompt_token_ids": FIRST}, greedy(2), resumable=True)
    run_turn(engine)
    engine.add_request("s", {"prompt_token_ids": [1]}, greedy(2))
    (final,) = engine.step()
    assert final.finished and final.request_id == "s"
    assert engine.scheduler.kv.num_free_blocks == free0


def test_bad_inputs_are_rejected_naming_the_session_and_change_nothing(engine: LLMEngine) -> None:
    free0 = engine.scheduler.kv.num_free_blocks
    with pytest.raises(RequestRejected, match=r"'nope'.*not an unfinished session"):
        engine.end_session("nope")
    with pytest.raises(RequestRejected, match=r"session 'x'.*stop strings"):
        engine.add_request("x", "hi", SamplingParams(stop=["."]), resumable=True)
    with pytest.raises(RequestRejected, match=r"session 'x'.*FINAL_ONLY"):
        engine.add_request("x", "hi", greedy(2), resumable=True, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("s", {"prompt_token_ids": FIRST}, greedy(3), resumable=True, output_kind=DELTA)
    engine.add_request("other", {"prompt_token_ids": SECOND}, greedy(3), output_kind=DELTA)
    with pytest.raises(RequestRejected, match="'other' is already in use"):
        engine.add_request("other", "x", greedy(1), resumable=True)
    with pytest.raises(RequestRejected, match="'other' is not a streaming-input session"):
        engine.end_session("other")
    # Past max_model_len (128): rejected, the session goes on as before.
    with pytest.raises(RequestRejected, match=r"session 's'.*max_model_len is 128"):
        engine.add_request("s", {"prompt_token_ids": [5] * 120}, None, resumable=True)
    with pytest.raises(RequestRejected, match=r"request 's'.*not in the vocabulary"):
        engine.add_request("s", {"prompt_token_ids": [10**6]}, None, resumable=True)
    got: dict[str, list[int]] = {"s": [], "other": []}
    for _ in range(50):
        for out in engine.step():
            got[out.request_id] += out.outputs[0].token_ids
        if not engine.scheduler.has_unfinished_requests():
            break
    assert len(got["s"]) == 3 and len(got["other"]) == 3
    engine.end_session("s")
    with pytest.raises(RequestRejected, match="'s' is not an unfinished session"):
        engine.end_session("s")
    assert engine.scheduler.kv.num_free_blocks == free0


def test_an_input_after_the_end_is_rejected_and_abort_frees_a_waiting_session(engine: LLMEngine) -> None:
    free0 = engine.scheduler.kv.num_free_blocks
    engine.add_request("s", {"prompt_token_ids": FIRST}, greedy(6), resumable=True)
    engine.step()
    engine.end_session("s")
    with pytest.raises(RequestRejected, match="session 's': its input already ended"):
        engine.add_request("s", {"prompt_token_ids": SECOND}, None, resumable=True)
    run_turn(engine)
    engine.add_request("t", {"prompt_token_ids": FIRST}, greedy(2), resumable=True)
    run_turn(engine, "t")
    assert engine.scheduler.kv.num_free_blocks < free0
    (aborted,) = engine.abort_request("t")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv.num_free_blocks == free0
    assert not engine.has_unfinished_requests()


def test_a_turn_ended_by_a_stop_token_reports_it_and_the_next_turn_starts_clean(engine: LLMEngine) -> None:
    engine.add_request("probe", {"prompt_token_ids": FIRST}, greedy(3), output_kind=DELTA)
    probe, _ = run_turn(engine, "probe")
    stop_at = token_ids(probe)[1]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
    engine.add_request("s", {"prompt_token_ids": FIRST}, params, resumable=True, output_kind=DELTA)
    turn1, _ = run_turn(engine)
    end = turn1[-1].outputs[0]
    assert (end.finish_reason, end.stop_reason) == ("stop", stop_at)
    assert token_ids(turn1) == token_ids(probe)[:2]
    engine.add_request("s", {"prompt_token_ids": SECOND}, greedy(2), resumable=True)
    turn2, _ = run_turn(engine)
    end = turn2[-1].outputs[0]
    assert (end.finish_reason, end.stop_reason) == ("length", None)
    (final,) = engine.end_session("s")
    assert final.finished and final.outputs[0].finish_reason == "length"
