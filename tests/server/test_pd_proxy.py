"""Disaggregated prefill/decode end to end: a prefill and a decode instance behind `llmsched proxy`.

The prefill instance is a `llmsched serve` process (so the last test can
kill it); the decode instance and a colocated reference run as server
threads (their engines are processes too).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import API_KEY_ENV, ServerArgs
from llmsched.server.launch import ServerThread

ENGINE = {"max_model_len": 256, "block_size": 16, "num_gpu_blocks_override": 96, "max_num_seqs": 8}
PRODUCER = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}
CONSUMER = {
    "kv_connector": "MooncakeConnector",
    "kv_role": "kv_consumer",
    # Far above HANG_S: a load that fails within it failed on a refused connection, not the timeout.
    "kv_connector_extra_config": {"load_timeout_s": 300.0},
}
# Upper bounds on waits only catch a hang: a loaded host may be slow, never this slow.
HANG_S = 60.0
PROMPTS = [
    "The quick brown fox jumps over the lazy dog " * 3,
    "hello",
    "Paged attention keeps KV in blocks. " * 4,
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], env: dict, pattern: str) -> tuple[subprocess.Popen, str]:
    """Start a server process; returns it and the URL its log names."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    seen: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, "".join(seen)
            continue
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("".join(seen))


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became healthy")


@pytest.fixture(scope="module")
def pd(embedded_cache: Path) -> Iterator[dict]:
    """Prefill process, decode and reference threads, and the proxy process."""
    env = {**os.environ, "LLMSCHED_CACHE_DIR": str(embedded_cache)}
    env.pop(API_KEY_ENV, None)
    serve = [sys.executable, "-m", "llmsched.cli", "serve", "--port", "0", "--log-level", "warning"]
    for k, v in ENGINE.items():
        serve += [f"--{k.replace('_', '-').replace('-override', '')}", str(v)]
    prefill, prefill_url = _start(
        [*serve, "--kv-transfer-config", json.dumps(PRODUCER)], env, r"on (http://127\.0\.0\.1:\d+)/v1"
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
    sargs = {"log_level": "warning", "engine_mode": "thread"}
    decode = ServerThread(EngineArgs(**ENGINE, kv_transfer_config=CONSUMER), ServerArgs(**sargs)).start()
    ref = ServerThread(EngineArgs(**ENGINE), ServerArgs(**sargs)).start()
    port = _free_port()
    proxy_cmd = [sys.executable, "-m", "llmsched.cli", "proxy", "--prefill", prefill_url]
    proxy_cmd += ["--decode", decode.base_url, "--port", str(port)]
    proxy = subprocess.Popen(proxy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    proxy_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(prefill_url)
        _wait_healthy(proxy_url)
        yield {
            "prefill": prefill,
            "prefill_url": prefill_url,
            "decode": decode,
            "ref": ref,
            "proxy": proxy_url,
        }
    finally:
        for p in (proxy, prefill):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in (proxy, prefill):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        decode.stop()
        ref.stop()
        mp.undo()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _complete(url: str, prompt: str, stream: bool, chat: bool = False) -> tuple[str, list[int] | None]:
    body: dict = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    body["return_token_ids"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return (c["message"]["content"] if chat else c["text"]), c.get("token_ids")
    text = ""
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text += (c.get("delta", {}).get("content") or "") if chat else c["text"]
    return text, None


def test_proxy_outputs_equal_a_colocated_engine_and_decode_computes_no_prompt(pd: dict) -> None:
    decode_url = pd["decode"].base_url
    names = ["external_prefix_cache_queries", "external_prefix_cache_hits", "prefix_cache_hits"]
    before = [_metric(decode_url, f"vllm:{n}_total") for n in names]
    for prompt in PROMPTS:
        for chat in (False, True):
            want = _complete(pd["ref"].base_url, prompt, False, chat)
            assert _complete(pd["proxy"], prompt, False, chat) == want
            assert _complete(pd["proxy"], prompt, True, chat)[0] == want[0]
    queries, ext_hits, local_hits = (
        _metric(decode_url, f"vllm:{n}_total") - b for n, b in zip(names, before)
    )
    # Each proxied prompt's tokens came from the prefill instance, or from the
    # decode instance's own prefix cache (a prompt seen before): none computed
    # there but the last one, whose logits a whole-prompt load recomputes.
    assert ext_hits > 0 and ext_hits + local_hits == queries
    assert _metric(decode_url, "vllm:kv_cache_usage_perc") == 0.0


def test_prefill_killed_recomputes_and_the_proxy_says_503(pd: dict) -> None:
    prompt = PROMPTS[2]
    want = _complete(pd["ref"].base_url, prompt, False)
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    r = httpx.post(pd["prefill_url"] + "/v1/completions", json=body, timeout=60)
    params = r.json()["kv_transfer_params"]
    # Killed while holding the blocks the decode instance is about to read.
    pd["prefill"].send_signal(signal.SIGKILL)
    pd["prefill"].wait(10)
    t0 = time.monotonic()
    body = {
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0.0,
        "ignore_eos": True,
        "kv_transfer_params": params,
    }
    body["return_token_ids"] = True
    r = httpx.post(pd["decode"].base_url + "/v1/completions", json=body, timeout=60)
    c = r.json()["choices"][0]
    assert (c["text"], c["token_ids"]) == want
    assert time.monotonic() - t0 < HANG_S
    assert _metric(pd["decode"].base_url, "vllm:kv_cache_usage_perc") == 0.0
    t0 = time.monotonic()
    r = httpx.post(pd["proxy"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=HANG_S)
    assert r.status_code == 503 and pd["prefill_url"] in r.json()["error"]["message"]
    assert httpx.get(pd["proxy"] + "/health", timeout=HANG_S).status_code == 503
    assert time.monotonic() - t0 < HANG_S
