"""GET /metrics under vLLM's names, GET /debug/steps, and the admission window, over real HTTP."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

WINDOW_MS = 1000


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model with an admission window and a short decision-trace buffer."""
    args = ServerArgs(admission_window_ms=WINDOW_MS, trace_steps=64, log_level="critical")
    with embedded_server(EngineArgs(max_model_len=128, num_gpu_blocks_override=512), args) as s:
        yield s


def complete(server: ServerThread, prompt: str, max_tokens: int = 4) -> dict:
    """One non-streamed completion."""
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_burst_inside_the_admission_window_is_admitted_in_one_step(server: ServerThread) -> None:
    ids: list[str] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        out = complete(server, f"burst {i}")
        with lock:
            ids.append(out["id"])

    threads = []
    t0 = time.monotonic()
    for i in range(6):
        t = threading.Thread(target=send, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(0.02)
    for t in threads:
        t.join(60)
    assert len(ids) == 6
    assert time.monotonic() - t0 >= WINDOW_MS / 1000
    steps = httpx.get(server.base_url + "/debug/steps", params={"last": 64}).json()["steps"]
    admitting = [s for s in steps if set(s["admitted"]) & set(ids)]
    assert len(admitting) == 1 and sorted(admitting[0]["admitted"]) == sorted(ids)


def test_debug_steps_explains_the_latest_decisions(server: ServerThread) -> None:
    rid = complete(server, "explain me", max_tokens=3)["id"]
    body = httpx.get(server.base_url + "/debug/steps", params={"last": 5, "explain": "true"}).json()
    assert body["trace_steps"] == 64
    steps = body["steps"]
    assert 1 <= len(steps) <= 5
    assert [s["step"] for s in steps] == sorted(s["step"] for s in steps)
    mine = [s for s in steps if any(e[0] == rid for e in s["why"]["entries"])]
    assert mine, steps
    entry = next(e for e in mine[-1]["why"]["entries"] if e[0] == rid)
    assert entry[2] == "scheduled" and entry[1] == 1 and entry[3] == "decode"
    assert f"{rid}: ran 1 token (decode)" in mine[-1]["explain"]
    assert rid in mine[-1]["finished"]
    assert len(httpx.get(server.base_url + "/debug/steps", params={"last": 1}).json()["steps"]) == 1
    # The ring buffer holds at most trace_steps steps however many ran.
    many = httpx.get(server.base_url + "/debug/steps", params={"last": 10_000}).json()["steps"]
    assert len(many) <= 64


def test_metrics_carry_vllms_names_types_and_labels(server: ServerThread) -> None:
    out = complete(server, "metrics", max_tokens=5)
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)
    }
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "llmsched:engine_steps": "counter",
    }
    for name, kind in expected.items():
        assert name in families, name
        assert families[name].type == kind, name
    sample = families["vllm:num_requests_running"].samples[0]
    assert sample.labels == {"model_name": "embedded-qwen3-v1", "engine": "0"}
    gen = next(s for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total"))
    assert gen.value >= out["usage"]["completion_tokens"] == 5
    ttft_count = next(
        s for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")
    )
    e2e_count = next(
        s for s in families["vllm:e2e_request_latency_seconds"].samples if s.name.endswith("_count")
    )
    assert ttft_count.value == e2e_count.value >= 1
    itl = [s for s in families["vllm:inter_token_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert itl[-1].labels["le"] == "+Inf" and all(a.value <= b.value for a, b in itertools.pairwise(itl))
    assert families["llmsched:engine_steps"].samples[0].value > 0
