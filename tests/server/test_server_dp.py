"""`llmsched serve --data-parallel-size 2`: two engine processes behind one API server."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest

from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.dp_args import dp_layout
from llmsched.server.launch import ServerThread
from support.dp_serving import ENGINE, HANG_S, PROMPTS, REPORT_S, complete, metric_samples, stream_lines


def dp_args(**kw: object) -> ServerArgs:
    """Server settings of the tests: two ranks, quiet."""
    return ServerArgs(log_level="warning", data_parallel_size=2, **kw)


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """Two ranks of the embedded model."""
    with embedded_server(EngineArgs(**ENGINE), dp_args()) as s:
        yield s


def test_greedy_completions_equal_one_engines_and_both_ranks_serve(
    server: ServerThread, embedded_server: Callable[..., AbstractContextManager]
) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        dp = list(pool.map(lambda p: complete(server.base_url, p)["choices"][0]["text"], PROMPTS))
    # Both ranks produced tokens, and each reports its own series under vLLM's engine label.
    generated = metric_samples(server.base_url, "vllm:generation_tokens_total")
    assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values()), generated
    assert sum(generated.values()) >= 8 * len(PROMPTS)
    assert set(metric_samples(server.base_url, "vllm:num_requests_running")) == {"0", "1"}
    # The server's own queue figures are the server's: one series, no engine label.
    text = httpx.get(server.base_url + "/metrics", timeout=HANG_S).text
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    with embedded_server(EngineArgs(**ENGINE), ServerArgs(log_level="warning")) as one:
        single = [complete(one.base_url, p)["choices"][0]["text"] for p in PROMPTS]
    assert dp == single


def test_debug_steps_name_their_rank_and_select_one(server: ServerThread) -> None:
    complete(server.base_url, PROMPTS[0])
    complete(server.base_url, PROMPTS[1])
    steps = httpx.get(server.base_url + "/debug/steps?last=50", timeout=HANG_S).json()["steps"]
    assert {s["rank"] for s in steps} == {0, 1}
    only1 = httpx.get(server.base_url + "/debug/steps?last=50&rank=1", timeout=HANG_S).json()["steps"]
    assert only1 and {s["rank"] for s in only1} == {1}
    r = httpx.get(server.base_url + "/debug/steps?rank=2", timeout=HANG_S)
    assert r.status_code == 400 and "2 data-parallel rank(s)" in r.text


def test_streaming_and_an_abort_free_every_block(server: ServerThread) -> None:
    body = {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=HANG_S) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])
    assert text == complete(server.base_url, PROMPTS[2])["choices"][0]["text"]
    # A long stream dropped after its first chunk is aborted on its rank.
    long = {**body, "max_tokens": 200}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=long, timeout=HANG_S) as s:
        next(s.iter_lines())
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        running = metric_samples(server.base_url, "vllm:num_requests_running")
        free = metric_samples(server.base_url, "llmsched:kv_cache_free_blocks")
        usable = metric_samples(server.base_url, "llmsched:kv_cache_usable_blocks")
        if sum(running.values()) == 0 and free == usable:
            break
        time.sleep(0.1)
    assert free == usable and sum(running.values()) == 0, (free, usable, running)
    aborted = metric_samples(server.base_url, "vllm:request_success_total")
    assert aborted  # every rank reports its finishes


def test_n_greater_than_one_answers_every_choice(server: ServerThread) -> None:
    out = complete(server.base_url, PROMPTS[3], n=3, temperature=1.0, seed=7)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 24
    again = complete(server.base_url, PROMPTS[3], n=3, temperature=1.0, seed=7)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"data_parallel_backend": "zmq"}, "must be one of mp, ray"),
        ({"data_parallel_size_local": 3}, "--data-parallel-size-local 3 must be in [1, 2]"),
        ({"data_parallel_size_local": 0}, "--data-parallel-size-local 0 must be in [1, 2]"),
        (
            {"data_parallel_start_rank": 1},
            "--data-parallel-start-rank 1 without --headless asks for vLLM's hybrid",
        ),
        (
            {"data_parallel_start_rank": 0, "data_parallel_size_local": 1},
            "--data-parallel-start-rank 0 without --headless asks for vLLM's hybrid",
        ),
        (
            {"headless": True, "data_parallel_start_rank": 1, "data_parallel_size_local": 2},
            "names ranks 1..2, beyond --data-parallel-size 2",
        ),
        ({"headless": True, "api_server_count": 1}, "--api-server-count 1 cannot go with --headless"),
        (
            {"headless": True, "data_parallel_backend": "ray"},
            "--headless cannot go with --data-parallel-backend ray",
        ),
        (
            {"data_parallel_backend": "ray", "data_parallel_size_local": 1},
            "--data-parallel-size-local 1 cannot go with --data-parallel-backend ray",
        ),
        ({"data_parallel_rpc_port": 0}, "--data-parallel-rpc-port 0 must be in [1, 65535]"),
        ({"data_parallel_join_timeout_s": 0.0}, "--data-parallel-join-timeout 0.0 must be > 0"),
        ({"api_server_count": 2}, "--api-server-count 2 is not available"),
        ({"engine_mode": "thread"}, "cannot go with --engine-mode thread"),
    ],
)
def test_settings_out_of_range_or_not_available_are_refused_by_name(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        dp_args(**kw)


def test_vllm_layouts_are_taken() -> None:
    args = dp_args(data_parallel_address="10.0.0.2", data_parallel_rpc_port=13345, api_server_count=1)
    assert args.data_parallel_size == 2 and args.data_parallel_backend == "mp"
    layout = dp_layout(dp_args(data_parallel_size_local=1, data_parallel_address="10.0.0.2"))
    assert (layout.local, layout.address, layout.port) == (1, "10.0.0.2", 29550)
    headless = dp_args(headless=True, data_parallel_start_rank=1, data_parallel_size_local=1)
    assert dp_layout(headless).start_rank == 1
    # As in vLLM, no API server process means a headless host.
    assert dp_args(api_server_count=0).headless
    assert dp_layout(dp_args(data_parallel_backend="ray")).local == 0


def test_structured_outputs_hold_on_every_rank(server: ServerThread) -> None:
    so = {"choice": ["alpha", "beta", "gamma"]}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(
                lambda p: complete(
                    server.base_url, p, structured_outputs=so, ignore_eos=False, max_tokens=16
                ),
                PROMPTS[:4],
            )
        )
    texts = [o["choices"][0]["text"] for o in outs]
    assert all(t in so["choice"] for t in texts), texts


# Last: it ends the module's server.
def test_a_killed_rank_fails_every_request_in_flight_and_the_server_goes_unhealthy(
    server: ServerThread,
) -> None:
    s = server
    backend = s.state.engine.backend
    pids = backend.pids()
    assert len(pids) == 2 and all(pids)
    started = [threading.Event() for _ in range(6)]

    def stream(i: int) -> list[str]:
        return stream_lines(s.base_url, PROMPTS[i], started[i])

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, i) for i in range(6)]
        # Under load: every request streams (three on each rank, as routed).
        assert all(e.wait(HANG_S) for e in started)
        running = metric_samples(s.base_url, "vllm:num_requests_running")
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        results = [f.result(timeout=HANG_S) for f in futures]
        ended = time.monotonic()
    assert running == {"0": 3.0, "1": 3.0}
    assert ended - killed < REPORT_S
    for lines in results:
        events = [json.loads(x) for x in lines if x != "[DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        assert errors, lines[-3:]
        assert "data-parallel rank 1" in errors[0]["message"] and "SIGKILL" in errors[0]["message"]
    health = httpx.get(s.base_url + "/health", timeout=HANG_S)
    assert health.status_code == 503 and "data-parallel rank 1" in health.text
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(s.base_url + "/v1/completions", json=body, timeout=HANG_S).status_code == 503
    # The surviving rank aborted its requests: every block of its cache is free again.
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        free = metric_samples(s.base_url, "llmsched:kv_cache_free_blocks")
        usable = metric_samples(s.base_url, "llmsched:kv_cache_usable_blocks")
        if free["0"] == usable["0"]:
            break
        time.sleep(0.1)
    assert free["0"] == usable["0"], (free, usable)
    assert backend.ranks[0].process.is_alive()
