"""WebSocket /v1/sessions on the embedded model: turns keep the KV, bad messages, leaving mid-turn."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from llmsched.engine.args import EngineArgs
from llmsched.server.app import build_app
from llmsched.server.args import ServerArgs
from llmsched.server.state import ServerState, create_state

MAX_LEN = 128


@pytest.fixture(scope="module")
def state(embedded_cache: Path) -> Iterator[ServerState]:
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
    try:
        yield create_state(
            EngineArgs(max_model_len=MAX_LEN, num_gpu_blocks_override=64, block_size=16),
            ServerArgs(engine_mode="thread", log_level="critical", api_key="k"),
        )
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def client(state: ServerState) -> Iterator[TestClient]:
    with TestClient(build_app(state), headers={"Authorization": "Bearer k"}) as c:
        yield c


def free_blocks(state: ServerState) -> int:
    return state.engine.snapshot.num_free_blocks


def wait_free(state: ServerState, expected: int) -> None:
    """The engine gets back to ``expected`` free blocks (the bound only catches a hang on a loaded host)."""
    deadline = time.monotonic() + 60
    while free_blocks(state) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert free_blocks(state) == expected


def read_turn(ws) -> tuple[list[int], str, dict]:
    """Messages up to the turn's end: its token ids, its text and the turn.done message."""
    ids: list[int] = []
    text = ""
    while True:
        msg = ws.receive_json()
        if msg["type"] == "output.delta":
            ids += msg["token_ids"]
            text += msg["text"]
        elif msg["type"] == "turn.done":
            return ids, text, msg
        else:
            raise AssertionError(f"unexpected message {msg}")


def test_a_session_ended_before_any_input_still_gets_session_done(client: TestClient, state) -> None:
    free0 = free_blocks(state)
    with client.websocket_connect("/v1/sessions") as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json({"type": "session.end"})
        assert ws.receive_json() == {"type": "session.done", "finish_reason": None}
        with pytest.raises(WebSocketDisconnect):
            ws.receive_json()
    wait_free(state, free0)


def test_two_turns_keep_the_kv_and_match_one_request_on_the_history(client: TestClient, state) -> None:
    first, second = list(range(40, 60)), list(range(70, 80))
    with client.websocket_connect("/v1/sessions") as ws:
        created = ws.receive_json()
        assert created["type"] == "session.created" and created["id"].startswith("session-")
        free0 = free_blocks(state)
        itl0 = state.metrics.itl.count
        first_input = {"prompt_token_ids": first, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        ws.send_json({**first_input, "user": "ws-tenant"})
        ids1, text1, done1 = read_turn(ws)
        assert len(ids1) == 5 and text1
        assert done1["finish_reason"] == "length"
        assert done1["usage"] == {"prompt_tokens": 20, "completion_tokens": 5}
        # The session holds its blocks between turns.
        assert free_blocks(state) < free0
        # No sampling fields: the session's carry on (greedy, 5 tokens).
        ws.send_json({"type": "input", "prompt_token_ids": second})
        ids2, _, done2 = read_turn(ws)
        assert len(ids2) == 5 and done2["usage"]["prompt_tokens"] == 10
        ws.send_json({"type": "session.end"})
        assert ws.receive_json() == {"type": "session.done", "finish_reason": "length"}
        # Inter-token latencies within each turn; the wait between turns is none.
        assert state.metrics.itl.count - itl0 == (5 - 1) + (5 - 1)
        with pytest.raises(WebSocketDisconnect):
            ws.receive_json()
    wait_free(state, free0)
    # Greedy: the second turn continues the history (its last sampled token is not part of it).
    history = first + ids1[:-1] + second
    resp = client.post(
        "/v1/completions",
        json={"prompt": history, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    assert resp.status_code == 200, resp.text
    single = client.post(
        "/tokenize", json={"prompt": resp.json()["choices"][0]["text"], "add_special_tokens": False}
    )
    assert single.json()["tokens"] == ids2
    # The first input's user is the session's tenant.
    assert 'tenant="ws-tenant"' in client.get("/metrics").text


def test_malformed_messages_get_errors_and_the_session_goes_on(client: TestClient, state) -> None:
    with client.websocket_connect("/v1/sessions") as ws:
        ws.receive_json()
        ws.send_text("not json")
        assert ws.receive_json()["code"] == "invalid_json"
        ws.send_json({"type": "dance"})
        assert ws.receive_json()["code"] == "unknown_event"
        ws.send_json({"prompt": "hi", "temperature": "hot"})
        err = ws.receive_json()
        assert err["code"] == "invalid_input" and "temperature" in err["error"]
        ws.send_json({"prompt": "hi", "stop": ["."]})
        assert "stop strings" in ws.receive_json()["error"]
        ws.send_json({"prompt_token_ids": [10**6]})
        assert "not in the vocabulary" in ws.receive_json()["error"]
        ws.send_json({"prompt": "hi", "priority": 3})
        assert "priority scheduling" in ws.receive_json()["error"]
        ws.send_json({"prompt": "x" * (MAX_LEN + 5)})
        assert "maximum context length" in ws.receive_json()["error"]
        ws.send_json({"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
        ids1, _, _ = read_turn(ws)
        assert len(ids1) == 3
        # Refused by the engine (past max_model_len): reported, the session goes on.
        ws.send_json({"prompt_token_ids": [5] * (MAX_LEN - 2)})
        err = ws.receive_json()
        assert err["code"] == "input_rejected" and "max_model_len" in err["error"]
        ws.send_json({"prompt": " again"})
        ids2, _, _ = read_turn(ws)
        assert len(ids2) == 3
        ws.send_json({"type": "session.end"})
        assert ws.receive_json()["type"] == "session.done"


def test_leaving_mid_turn_frees_the_blocks_and_other_requests_run_on(client: TestClient, state) -> None:
    with client.websocket_connect("/v1/sessions") as ws:
        ws.receive_json()
        free0 = free_blocks(state)
        ws.send_json({"prompt": "a long answer", "max_tokens": 100, "ignore_eos": True})
        assert ws.receive_json()["type"] == "output.delta"
    wait_free(state, free0)
    resp = client.post("/v1/completions", json={"prompt": "still", "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


def test_the_api_key_guards_sessions(client: TestClient) -> None:
    bad = {"Authorization": "Bearer wrong"}
    with pytest.raises(WebSocketDisconnect), client.websocket_connect("/v1/sessions", headers=bad) as ws:
        ws.receive_json()


def test_leaving_between_turns_frees_the_blocks(client: TestClient, state) -> None:
    with client.websocket_connect("/v1/sessions") as ws:
        ws.receive_json()
        free0 = free_blocks(state)
        ws.send_json({"prompt": "one turn", "max_tokens": 3, "ignore_eos": True})
        read_turn(ws)
        assert free_blocks(state) < free0  # held for the next input that never comes
    wait_free(state, free0)


def test_a_later_input_setting_some_fields_keeps_the_sessions_others(client: TestClient, state) -> None:
    first, second = list(range(40, 60)), list(range(70, 80))
    with client.websocket_connect("/v1/sessions") as ws:
        ws.receive_json()
        ws.send_json({"prompt_token_ids": first, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        ids1, _, _ = read_turn(ws)
        # Only max_tokens: temperature 0 and ignore_eos carry on, so the turn stays greedy.
        ws.send_json({"prompt_token_ids": second, "max_tokens": 3})
        ids2, _, done2 = read_turn(ws)
        assert len(ids2) == 3 and done2["finish_reason"] == "length"
        ws.send_json({"type": "session.end"})
        assert ws.receive_json()["type"] == "session.done"
    history = first + ids1[:-1] + second
    resp = client.post(
        "/v1/completions", json={"prompt": history, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    )
    assert resp.status_code == 200, resp.text
    single = client.post(
        "/tokenize", json={"prompt": resp.json()["choices"][0]["text"], "add_special_tokens": False}
    )
    assert single.json()["tokens"] == ids2
