"""A tiny Hugging Face Llama (random weights, no tokenizer) behind prefill, decode and the proxy.

Token ids in, token ids out; the reference is transformers' own greedy
generate() on the same weights.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread
from llmsched.server.proxy import PDProxy, build_app

KV = {"kv_connector": "MooncakeConnector"}
# Upper bounds on waits only catch a hang: a loaded host may be slow, never this slow.
HANG_S = 60.0


def _tiny_llama(folder: Path) -> LlamaForCausalLM:
    torch.manual_seed(5)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def hf_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The proxy's URL in front of a producer and a consumer on the tiny model, the servers and the model."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    model = _tiny_llama(folder)
    # float32, as the transformers reference runs.
    base = {"model": str(folder), "dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 256}
    base["block_size"] = 16
    base["num_gpu_blocks_override"] = 64
    # The engines on threads of this process: no process start-ups to wait for.
    sargs = {"log_level": "warning", "engine_mode": "thread"}
    # Blocks nobody reads are freed after a second (the decode instance dies in the last test).
    producer = {**KV, "kv_role": "kv_producer", "kv_connector_extra_config": {"abort_timeout_s": 1.0}}
    prefill = ServerThread(EngineArgs(**base, kv_transfer_config=producer), ServerArgs(**sargs))
    decode = ServerThread(
        EngineArgs(**base, kv_transfer_config={**KV, "kv_role": "kv_consumer"}), ServerArgs(**sargs)
    )
    prefill.start()
    decode.start()
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(PDProxy([prefill.base_url], [decode.base_url], 60)), port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield {"url": f"http://127.0.0.1:{port}", "model": model, "prefill": prefill, "decode": decode}
    finally:
        server.should_exit = True
        thread.join(10)
        decode.stop()
        prefill.stop()


def _greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def test_tiny_hf_model_through_the_proxy_equals_transformers(hf_pd: dict) -> None:
    url, model = hf_pd["url"], hf_pd["model"]
    for i, n in enumerate((20, 47, 130)):
        prompt = [(17 * j + 3 * i) % 290 + 5 for j in range(n)]
        want = _greedy(model, prompt, 8)
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        got: list[int] = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        got.extend(c.get("token_ids") or [])
        assert got == want


def _kv_usage(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r"^vllm:kv_cache_usage_perc(?:{[^}]*})? (\S+)$", text, re.M)
    assert m is not None
    return float(m.group(1))


def test_a_dead_decode_instance_is_a_503_and_the_prefill_frees_its_blocks(hf_pd: dict) -> None:
    decode_url = hf_pd["decode"].base_url
    hf_pd["decode"].stop()
    t0 = time.monotonic()
    body = {"prompt": list(range(5, 105)), "max_tokens": 4}
    r = httpx.post(hf_pd["url"] + "/v1/completions", json=body, timeout=2 * HANG_S)
    assert r.status_code == 503 and decode_url in r.json()["error"]["message"]
    # Refused at once, not left to the proxy's 600 s request timeout.
    assert time.monotonic() - t0 < HANG_S
    # The prefill instance prefilled and held the request's blocks for a reader that never comes.
    prefill_url = hf_pd["prefill"].base_url
    deadline = time.monotonic() + HANG_S
    while _kv_usage(prefill_url) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _kv_usage(prefill_url) == 0.0
