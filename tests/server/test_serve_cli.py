"""`llmsched serve`: vLLM's flag names, and the real command serving until interrupted."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from llmsched.cli import build_parser, main
from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.batch_defaults import Platform
from llmsched.server.args import API_KEY_ENV, ServerArgs


def parse(argv: list[str]) -> tuple[EngineArgs, ServerArgs]:
    """Both argument sets from a `serve` command line."""
    args = build_parser().parse_args(["serve", *argv])
    return EngineArgs.from_cli_args(args), ServerArgs.from_cli_args(args)


def test_serve_takes_vllms_server_and_engine_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    engine, server = parse(
        [
            "--host", "0.0.0.0", "--port", "9001", "--api-key", "k", "--served-model-name", "a", "b",
            "--admission-window-ms", "5", "--max-num-queued-reqs", "7", "--max-num-queued-tokens", "900",
            "--max-num-batched-tokens", "4096", "--max-num-seqs", "32", "--scheduling-policy", "priority",
            "--no-enable-prefix-caching", "--trace-steps", "0",
        ]
    )  # fmt: skip
    assert (server.host, server.port, server.api_key) == ("0.0.0.0", 9001, "k")
    assert server.served_model_name == ["a", "b"]
    assert (server.admission_window_ms, server.max_num_queued_requests, server.max_num_queued_tokens) == (
        5,
        7,
        900,
    )
    assert server.trace_steps == 0
    assert (engine.max_num_batched_tokens, engine.max_num_seqs) == (4096, 32)
    assert engine.scheduling_policy == "priority" and not engine.enable_prefix_caching


def test_defaults_bound_the_queue_and_read_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    engine, server = parse([])
    assert engine.model is None and server.api_key == "from-env"
    assert (server.host, server.port, server.admission_window_ms) == ("127.0.0.1", 8000, 0.0)
    # max_num_seqs resolves at startup: vLLM's serve default on CPU, 128.
    assert engine.max_num_seqs is None and engine.usage_context == "OPENAI_API_SERVER"
    assert server.queue_limit(engine.batch_limits(Platform("cpu")).max_num_seqs) == 1024
    assert server.queue_limit(512) == 2048


def test_a_positional_model_is_the_model_and_a_conflict_is_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "/no/such/model", "--model", "/other"]) == 2
    assert "two models given" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        ServerArgs(port=70000)
    with pytest.raises(ConfigError):
        ServerArgs(max_num_queued_requests=0)


def test_the_serve_command_serves_and_stops_on_ctrl_c(embedded_cache: Path) -> None:
    env = {**os.environ, "LLMSCHED_CACHE_DIR": str(embedded_cache)}
    env.pop(API_KEY_ENV, None)
    cmd = [
        sys.executable, "-m", "llmsched.cli", "serve", "--port", "0", "--max-model-len", "64",
        "--num-gpu-blocks", "128", "--api-key", "secret", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    try:
        url = None
        seen = []
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
                continue
            seen.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            url = m.group(1) if m else None
        assert url is not None, "".join(seen)
        assert any("RANDOM weights" in x for x in seen)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 3},
            headers={"Authorization": "Bearer secret"},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["model"] == "embedded-qwen3-v1"
        assert httpx.get(url + "/v1/models").status_code == 401
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
