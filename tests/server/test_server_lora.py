"""LoRA behind the server: --lora-modules, the ``model`` field, /v1/models and the load/unload endpoints."""

from __future__ import annotations

import pickle

import httpx
import pytest

from llmsched import LoRARequest, SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.engine_messages import Add
from llmsched.server.launch import ServerThread
from llmsched.server.lora_modules import LoRAModule, parse_lora_module
from support.hf_reference import hf_greedy
from support.lora import make_adapter, tiny_llama

pytest.importorskip("peft")

PROMPT = [5, 17, 42, 9, 100, 3]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Llama, two adapters, and the reference continuation of PROMPT under each (and the base)."""
    root = tmp_path_factory.mktemp("server_lora")
    base = tiny_llama(root / "base", seed=4)
    refs = {"base": hf_greedy(base, PROMPT, MAX_TOKENS)}
    for name, rank in (("a1", 4), ("a2", 8)):
        refs[name] = hf_greedy(
            make_adapter(base, root / name, rank=rank, alpha=rank, seed=rank), PROMPT, MAX_TOKENS
        )
    return {"root": root, "refs": refs}


def complete(client: httpx.Client, model: str) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return client.post("/v1/completions", json=body)


def test_adapters_are_served_by_name_and_loaded_at_run_time(folders: dict) -> None:
    root, refs = folders["root"], folders["refs"]
    engine_args = EngineArgs(
        model=str(root / "base"),
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=4,
        num_gpu_blocks_override=64,
        max_model_len=64,
        max_num_seqs=4,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    server_args = ServerArgs(
        served_model_name=["tiny"], lora_modules=[LoRAModule("a1", str(root / "a1"))], log_level="warning"
    )
    with ServerThread(engine_args, server_args) as s, httpx.Client(base_url=s.base_url, timeout=60) as c:
        models = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("a1", "tiny")]
        r = complete(c, "a1").json()
        assert r["model"] == "a1" and r["choices"][0]["token_ids"] == refs["a1"]
        assert complete(c, "tiny").json()["choices"][0]["token_ids"] == refs["base"]
        assert complete(c, "a2").status_code == 404

        ok = c.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")})
        assert ok.status_code == 200 and "added successfully" in ok.text
        assert complete(c, "a2").json()["choices"][0]["token_ids"] == refs["a2"]
        again = c.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "nowhere")})
        assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "a1", "a2"]

        gone = c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert gone.status_code == 200 and "removed successfully" in gone.text
        assert complete(c, "a2").status_code == 404
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
        # a1 still answers as before.
        assert complete(c, "a1").json()["choices"][0]["token_ids"] == refs["a1"]


def test_lora_modules_need_enable_lora_and_parse_both_forms(folders: dict) -> None:
    assert parse_lora_module("a=/x/y") == LoRAModule("a", "/x/y")
    assert parse_lora_module('{"name": "b", "path": "/p"}') == LoRAModule("b", "/p")
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("nopath")
    args = EngineArgs(model=str(folders["root"] / "base"), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        ServerThread(args, ServerArgs(lora_modules=[LoRAModule("a1", "/x")]))


def test_an_add_with_an_adapter_crosses_the_process_pipe() -> None:
    add = Add("r", [1, 2], SamplingParams(), 0.0, lora_request=LoRARequest("a", 3, "/p"))
    assert pickle.loads(pickle.dumps(add)).lora_request == LoRARequest("a", 3, "/p")
