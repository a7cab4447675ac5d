"""The server on a hybrid (Bamba) folder: /v1/completions and a /v1/sessions WebSocket equal transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import BambaForCausalLM

from llmsched import LLM, SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.server.app import build_app
from llmsched.server.args import ServerArgs
from llmsched.server.state import ServerState, create_state
from support.hf_reference import hf_greedy
from support.tiny_bamba import VOCAB, build_tiny_bamba

MAX_TOKENS = 6


def engine_args(folder: Path) -> EngineArgs:
    return EngineArgs(
        model=str(folder),
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=4,
        num_gpu_blocks_override=96,
        max_model_len=96,
    )


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BambaForCausalLM]:
    folder = tmp_path_factory.mktemp("server-bamba")
    return folder, build_tiny_bamba(folder)


@pytest.fixture(scope="module")
def state(bamba: tuple[Path, BambaForCausalLM]) -> Iterator[ServerState]:
    yield create_state(engine_args(bamba[0]), ServerArgs(engine_mode="thread", log_level="critical"))


@pytest.fixture(scope="module")
def client(state: ServerState) -> Iterator[TestClient]:
    with TestClient(build_app(state)) as c:
        yield c


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_completions_equal_llm_generate_and_transformers(
    bamba: tuple[Path, BambaForCausalLM], client: TestClient
) -> None:
    folder, hf = bamba
    prompts = [prompt(11, 1), prompt(6, 2)]
    got = []
    for p in prompts:
        body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        got.append(resp.json()["choices"][0]["token_ids"])
    llm = LLM(**{k: getattr(engine_args(folder), k) for k in ("model", "dtype", "skip_tokenizer_init")})
    try:
        assert llm.llm_engine.scheduler_config.mamba
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        offline = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        llm.close()
    assert got == [o.outputs[0].token_ids for o in offline]
    assert got == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def read_turn(ws) -> tuple[list[int], dict]:
    ids: list[int] = []
    while True:
        msg = ws.receive_json()
        if msg["type"] == "output.delta":
            ids += msg["token_ids"]
        elif msg["type"] == "turn.done":
            return ids, msg
        else:
            raise AssertionError(f"unexpected message {msg}")


def test_a_websocket_session_keeps_the_mamba_state_between_turns(
    bamba: tuple[Path, BambaForCausalLM], client: TestClient, state: ServerState
) -> None:
    hf = bamba[1]
    first, second = prompt(13, 3), prompt(7, 4)
    with client.websocket_connect("/v1/sessions") as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json({"prompt_token_ids": first, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        ids1, done1 = read_turn(ws)
        assert done1["finish_reason"] == "length"
        ws.send_json(
            {"prompt_token_ids": second, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        )
        ids2, done2 = read_turn(ws)
        assert done2["usage"]["prompt_tokens"] == len(second)  # only the new input is prefilled
        ws.send_json({"type": "session.end"})
        assert ws.receive_json() == {"type": "session.done", "finish_reason": "length"}
    assert ids1 == hf_greedy(hf, first, 4)
    assert ids2 == hf_greedy(hf, first + ids1[:-1] + second, MAX_TOKENS)
