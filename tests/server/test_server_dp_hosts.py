"""Data-parallel ranks on two "hosts" over loopback: the API server with rank 0, --headless with rank 1."""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

import llmsched
from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.dp.proc_transport import free_port
from llmsched.server.args import ServerArgs
from llmsched.server.dp_link import AUTHKEY_ENV, accept, listen
from llmsched.server.dp_remote import accept_ranks
from llmsched.server.launch import ServerThread
from llmsched.server.state import make_backend
from support.dp_serving import ENGINE, HANG_S, PROMPTS, REPORT_S, complete, metric_samples, stream_lines

ENGINE_FLAGS = ["--max-model-len", "1024", "--num-gpu-blocks-override", "256", "--block-size", "16"]
ENGINE_FLAGS += ["--num-threads", "1", "--no-prefault-kv-cache"]


def start_headless(cache: Path, port: int, key: str, *extra: str) -> subprocess.Popen:
    """`llmsched serve --headless` for rank 1 of 2, joining 127.0.0.1:port, as another host would run it."""
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(llmsched.__file__).parents[1]),
        "LLMSCHED_CACHE_DIR": str(cache),
        AUTHKEY_ENV: key,
    }
    cmd = [sys.executable, "-m", "llmsched.cli", "serve", "--headless", "--data-parallel-size", "2"]
    cmd += ["--data-parallel-start-rank", "1", "--data-parallel-size-local", "1"]
    cmd += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)]
    cmd += [*ENGINE_FLAGS, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def all_gone(pids: list[int]) -> bool:
    """Whether every one of ``pids`` exits within HANG_S."""
    deadline = time.monotonic() + HANG_S
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(gone(p) for p in pids)


def api_args(port: int, **kw: object) -> ServerArgs:
    """The API server's host: rank 0 here, rank 1 to join at 127.0.0.1:port."""
    return ServerArgs(
        log_level="warning",
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=port,
        **kw,
    )


@pytest.fixture(scope="module")
def hosts(
    embedded_server: Callable[..., AbstractContextManager], embedded_cache: Path
) -> Iterator[tuple[ServerThread, subprocess.Popen]]:
    """The API server (rank 0) and the headless process (rank 1), started in the other order."""
    port, key = free_port(), secrets.token_hex(16)
    # The headless host may start first: it retries until the API server listens.
    headless = start_headless(embedded_cache, port, key)
    mp = pytest.MonkeyPatch()
    mp.setenv(AUTHKEY_ENV, key)
    try:
        with embedded_server(EngineArgs(**ENGINE), api_args(port, data_parallel_join_timeout_s=HANG_S)) as s:
            yield s, headless
    finally:
        mp.undo()
        if headless.poll() is None:
            headless.kill()
        headless.communicate(timeout=HANG_S)


def test_requests_reach_both_hosts_and_equal_one_engines(
    hosts: tuple[ServerThread, subprocess.Popen], embedded_server: Callable[..., AbstractContextManager]
) -> None:
    server, headless = hosts
    assert any(f"headless process {headless.pid}" in line for line in server.state.startup_log)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        dp = list(pool.map(lambda p: complete(server.base_url, p)["choices"][0]["text"], PROMPTS))
    generated = metric_samples(server.base_url, "vllm:generation_tokens_total")
    assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values()), generated
    steps = httpx.get(server.base_url + "/debug/steps?last=50&rank=1", timeout=HANG_S).json()["steps"]
    assert steps and {s["rank"] for s in steps} == {1}
    with embedded_server(EngineArgs(**ENGINE), ServerArgs(log_level="warning")) as one:
        single = [complete(one.base_url, p)["choices"][0]["text"] for p in PROMPTS]
    assert dp == single


# Last of the module's server tests: it ends the headless host.
def test_a_killed_headless_host_fails_every_request_in_flight(
    hosts: tuple[ServerThread, subprocess.Popen],
) -> None:
    server, headless = hosts
    started = [threading.Event() for _ in range(4)]

    def stream(i: int) -> list[str]:
        return stream_lines(server.base_url, PROMPTS[i], started[i])

    engines = children(headless.pid)
    assert engines, "the headless process runs its rank in a child process"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        assert all(e.wait(HANG_S) for e in started)
        running = metric_samples(server.base_url, "vllm:num_requests_running")
        killed = time.monotonic()
        headless.send_signal(signal.SIGKILL)
        results = [f.result(timeout=HANG_S) for f in futures]
        ended = time.monotonic()
    assert running == {"0": 2.0, "1": 2.0}
    assert ended - killed < REPORT_S
    for lines in results:
        errors = [json.loads(x)["error"] for x in lines if x != "[DONE]" and "error" in json.loads(x)]
        assert errors, lines[-3:]
        message = errors[0]["message"]
        assert "data-parallel rank 1" in message and f"headless process {headless.pid}" in message, message
    assert httpx.get(server.base_url + "/health", timeout=HANG_S).status_code == 503
    # The killed host's engine process sees its pipe close and stops too.
    assert all_gone(engines)


def test_the_api_server_gives_up_on_ranks_that_never_join(
    use_embedded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(AUTHKEY_ENV, "k")
    port = free_port()
    with pytest.raises(ConfigError) as e:
        make_backend(EngineArgs(**ENGINE), api_args(port, data_parallel_join_timeout_s=1.0))
    assert "data-parallel rank(s) 1 did not join within 1 s" in str(e.value)
    assert "--headless --data-parallel-size 2 --data-parallel-start-rank R" in str(e.value)


def test_ranks_on_other_hosts_need_the_shared_secret(
    use_embedded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"set {AUTHKEY_ENV} to the same value on every host"):
        make_backend(EngineArgs(**ENGINE), api_args(free_port()))


def test_a_headless_host_exits_when_its_api_server_goes(embedded_cache: Path) -> None:
    port, key = free_port(), "shared"
    server = listen("127.0.0.1", port)
    # A host with the wrong secret is refused, and says why.
    wrong = start_headless(embedded_cache, port, "other")
    deadline = time.monotonic() + HANG_S
    while wrong.poll() is None and time.monotonic() < deadline:
        assert accept(server, key.encode(), time.monotonic() + 0.5) is None
    out, _ = wrong.communicate(timeout=HANG_S)
    assert wrong.returncode != 0 and f"is {AUTHKEY_ENV} the same?" in out
    headless = start_headless(embedded_cache, port, key)
    try:
        rank = accept_ranks(server, key.encode(), [1], 2, HANG_S, "")[1]
        rank.wait_started(HANG_S)
        engines = children(headless.pid)
        lost = time.monotonic()
        rank.kill()  # as the API server's host vanishing closes the link
        out, _ = headless.communicate(timeout=HANG_S)
        assert time.monotonic() - lost < REPORT_S
    finally:
        server.close()
        if headless.poll() is None:
            headless.kill()
    assert headless.returncode == 1
    assert "lost the API server at 127.0.0.1" in out, out
    assert engines and all_gone(engines)
