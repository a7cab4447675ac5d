"""A /v1/sessions WebSocket runs the LoRA adapter its first input's ``model`` names, as completions do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from llmsched.engine.args import EngineArgs
from llmsched.server.app import build_app
from llmsched.server.args import ServerArgs
from llmsched.server.lora_modules import LoRAModule
from llmsched.server.state import create_state
from support.hf_reference import hf_greedy
from support.lora import make_adapter, tiny_llama

pytest.importorskip("peft")

FIRST = [5, 17, 42, 9, 100, 3, 77]
SECOND = [11, 250, 8]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module | Path]:
    root = tmp_path_factory.mktemp("session_lora")
    base = tiny_llama(root / "base", seed=4)
    merged = make_adapter(base, root / "a1", rank=4, alpha=4, seed=4)
    return {"root": root, "base": base, "a1": merged}


@pytest.fixture(scope="module")
def client(models: dict) -> Iterator[TestClient]:
    root = models["root"]
    engine_args = EngineArgs(
        model=str(root / "base"),
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=4,
        num_gpu_blocks_override=64,
        max_model_len=64,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=4,
    )
    server_args = ServerArgs(
        served_model_name=["tiny"],
        lora_modules=[LoRAModule("a1", str(root / "a1"))],
        engine_mode="thread",
        log_level="critical",
    )
    with TestClient(build_app(create_state(engine_args, server_args))) as c:
        yield c


def read_turn(ws) -> list[int]:
    ids: list[int] = []
    while True:
        msg = ws.receive_json()
        if msg["type"] == "output.delta":
            ids += msg["token_ids"]
        elif msg["type"] == "turn.done":
            return ids
        else:
            raise AssertionError(f"unexpected message {msg}")


def two_turns(client: TestClient, model: str | None, second_model: str | None = None) -> tuple[list, list]:
    """A two-turn session, its first input naming ``model`` (and its second ``second_model``)."""
    first = {"prompt_token_ids": FIRST, "max_tokens": 4, **GREEDY}
    second = {"prompt_token_ids": SECOND, "max_tokens": 5, **GREEDY}
    if model is not None:
        first["model"] = model
    if second_model is not None:
        second["model"] = second_model
    with client.websocket_connect("/v1/sessions") as ws:
        ws.receive_json()
        ws.send_json(first)
        ids1 = read_turn(ws)
        ws.send_json(second)
        ids2 = read_turn(ws)
        ws.send_json({"type": "session.end"})
        assert ws.receive_json()["type"] == "session.done"
    return ids1, ids2


@pytest.mark.parametrize("model", ["a1", "tiny", None])
def test_the_first_inputs_model_picks_the_adapter_for_every_turn(
    client: TestClient, models: dict, model
) -> None:
    hf = models["a1" if model == "a1" else "base"]
    ids1, ids2 = two_turns(client, model, second_model=model)
    assert ids1 == hf_greedy(hf, FIRST, 4)
    assert ids2 == hf_greedy(hf, FIRST + ids1[:-1] + SECOND, 5)


def test_an_input_cannot_switch_the_adapter_or_name_an_unknown_one(client: TestClient, models: dict) -> None:
    with client.websocket_connect("/v1/sessions") as ws:
        ws.receive_json()
        ws.send_json({"prompt_token_ids": FIRST, "model": "nope", "max_tokens": 2})
        err = ws.receive_json()
        assert err["code"] == "invalid_input" and "nope" in err["error"]
        ws.send_json({"prompt_token_ids": FIRST, "model": "a1", "max_tokens": 4, **GREEDY})
        ids1 = read_turn(ws)
        ws.send_json({"prompt_token_ids": SECOND, "model": "tiny"})
        err = ws.receive_json()
        assert err["code"] == "invalid_input" and "'a1'" in err["error"] and "'tiny'" in err["error"]
        ws.send_json({"prompt_token_ids": SECOND, "max_tokens": 5, **GREEDY})  # no model: the session's
        ids2 = read_turn(ws)
        ws.send_json({"type": "session.end"})
        assert ws.receive_json()["type"] == "session.done"
    assert ids1 == hf_greedy(models["a1"], FIRST, 4)
    assert ids2 == hf_greedy(models["a1"], FIRST + ids1[:-1] + SECOND, 5)
