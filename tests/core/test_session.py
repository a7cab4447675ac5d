"""Streaming-input sessions in the scheduler: KV kept between turns, inputs queued, end of input."""

from __future__ import annotations

import pytest

from llmsched.core.errors import RequestRejected
from llmsched.core.request import RequestStatus
from support.scheduling import make_req, make_sched, run_step


def finish_turn(s, rid: str) -> None:
    """Step until ``rid`` reports a finished turn."""
    for _ in range(100):
        _, res = run_step(s)
        if any(r.request_id == rid for r in res.finished):
            return
    raise AssertionError(f"{rid} never finished a turn")


def test_turn_end_keeps_blocks_and_waits_for_input() -> None:
    s = make_sched()
    s.add_request(make_req("S", 10, max_tokens=2, resumable=True))
    finish_turn(s, "S")
    req = s.requests["S"]
    assert req.status is RequestStatus.WAITING_FOR_INPUT
    assert s.kv.num_held_blocks("S") == 3  # 11 tokens computed of 12, 4-token blocks
    assert s.num_waiting == 1 and not s.has_unfinished_requests() and not s.has_requests()


def test_resume_computes_only_the_new_input() -> None:
    s = make_sched()
    s.add_request(make_req("S", 10, max_tokens=2, resumable=True))
    finish_turn(s, "S")
    s.add_request(make_req("S", 5, max_tokens=3, resumable=True))
    req = s.requests["S"]
    # Prompt: all 12 tokens but the last sampled one, plus the 5 new ones.
    assert req.num_prompt_tokens == 16 and req.num_computed_tokens == 11
    out, _ = run_step(s)
    assert out.num_scheduled_tokens_by_id() == {"S": 5}
    assert out.admitted_num_cached_tokens == [11]
    finish_turn(s, "S")
    assert req.num_output_tokens == 3


def test_input_during_a_turn_is_queued_then_the_end_finishes_the_session() -> None:
    s = make_sched()
    s.add_request(make_req("S", 8, max_tokens=3, resumable=True))
    run_step(s)
    s.add_request(make_req("S", 4, max_tokens=1, resumable=True))
    s.add_request(make_req("S", 1, max_tokens=1))  # end of input
    finish_turn(s, "S")
    assert s.requests["S"].status is RequestStatus.WAITING  # resumed at once with the queued input
    finish_turn(s, "S")
    assert "S" not in s.requests
    assert s.kv.num_free_blocks == s.config.num_gpu_blocks - 1


def test_input_after_the_end_is_rejected() -> None:
    s = make_sched()
    s.add_request(make_req("S", 8, max_tokens=3, resumable=True))
    run_step(s)
    s.add_request(make_req("S", 1, max_tokens=1))
    with pytest.raises(RequestRejected, match="already ended"):
        s.add_request(make_req("S", 4, max_tokens=1, resumable=True))
    finish_turn(s, "S")
    assert "S" not in s.requests


def test_end_of_input_aborts_a_waiting_session_and_frees_its_blocks() -> None:
    s = make_sched()
    s.add_request(make_req("S", 8, max_tokens=1, resumable=True))
    finish_turn(s, "S")
    s.add_request(make_req("S", 1, max_tokens=1))
    assert "S" not in s.requests and s.sessions.num_waiting_for_input == 0
    assert s.kv.num_free_blocks == s.config.num_gpu_blocks - 1


def test_bad_inputs_are_rejected_without_harm() -> None:
    s = make_sched(max_model_len=32)
    s.add_request(make_req("S", 8, max_tokens=1, resumable=True))
    s.add_request(make_req("A", 8))
    finish_turn(s, "S")
    with pytest.raises(RequestRejected, match="max_model_len"):
        s.add_request(make_req("S", 30, max_tokens=1, resumable=True))
    # The session and the other request are untouched.
    assert s.requests["S"].status is RequestStatus.WAITING_FOR_INPUT
    s.add_request(make_req("S", 4, max_tokens=1, resumable=True))
    finish_turn(s, "S")
    with pytest.raises(RequestRejected, match="already in use"):
        s.add_request(make_req("A", 4))


def test_waiting_sessions_keep_their_sequence_slot() -> None:
    s = make_sched(max_num_seqs=1)
    s.add_request(make_req("S", 4, max_tokens=1, resumable=True))
    finish_turn(s, "S")
    s.add_request(make_req("A", 4))
    out, _ = run_step(s)
    assert out.scheduled == []
    s.add_request(make_req("S", 1, max_tokens=1))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens_by_id() == {"A": 4}
