"""A real Prometheus scrapes the server and answers PromQL over vLLM's metric names.

Runs when a ``prometheus`` binary is found (on PATH, e.g. Debian's
prometheus package, or named by LLMSCHED_PROMETHEUS); skipped otherwise.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

PROMETHEUS = os.environ.get("LLMSCHED_PROMETHEUS") or shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus, or set LLMSCHED_PROMETHEUS)"
)
LOAD_S = 12.0


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model."""
    args = ServerArgs(log_level="warning", engine_mode="thread")
    with embedded_server(EngineArgs(max_model_len=256, num_gpu_blocks_override=256), args) as s:
        yield s


@pytest.fixture(scope="module")
def prometheus(server: ServerThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus on 127.0.0.1 scraping the server every second; yields its base URL."""
    d: Path = tmp_path_factory.mktemp("prometheus")
    config = d / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: llmsched\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "prometheus exited at start"
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def load(server: ServerThread, seconds: float) -> int:
    """Completions from two clients for ``seconds``; returns the tokens generated.

    A client's failed assertion is raised here, in the test, by its future's result.
    """
    stop = time.monotonic() + seconds

    def client(i: int) -> int:
        tokens = 0
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            while time.monotonic() < stop:
                body = {"prompt": f"client {i} at {time.monotonic()}", "max_tokens": 8, "ignore_eos": True}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                tokens += r.json()["usage"]["completion_tokens"]
        return tokens

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(client, i) for i in range(2)]
        return sum(f.result(timeout=seconds + 60) for f in futures)


def instant(prometheus: str, query: str) -> float:
    """The single value of an instant PromQL query."""
    r = httpx.get(prometheus + "/api/v1/query", params={"query": query}, timeout=10).json()
    assert r["status"] == "success", r
    result = r["data"]["result"]
    assert len(result) == 1, (query, result)
    return float(result[0]["value"][1])


def test_prometheus_answers_rates_and_quantiles(server: ServerThread, prometheus: str) -> None:
    t0 = time.monotonic()
    generated = load(server, LOAD_S)
    elapsed = time.monotonic() - t0
    time.sleep(2.5)  # the last scrape after the load
    targets = httpx.get(prometheus + "/api/v1/targets").json()["data"]["activeTargets"]
    assert [t["health"] for t in targets] == ["up"], targets
    rate = instant(prometheus, "sum(rate(vllm:generation_tokens_total[30s]))")
    # The whole load fell inside the 30 s window: the rate is about the tokens over the window
    # (Prometheus extrapolates near the series' start, hence the slack).
    mean = generated / elapsed
    assert generated > 0 and 0.3 * generated / 30 < rate < 2 * generated / 30, (rate, generated)
    ttft = "sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[30s]))"
    p90 = instant(prometheus, f"histogram_quantile(0.9, {ttft})")
    assert math.isfinite(p90) and 0 < p90 < 30, p90
    # The latest scrape holds exactly what the clients were sent.
    assert instant(prometheus, "sum(vllm:generation_tokens_total)") == generated
    print(f"rate {rate:.1f} tok/s (load mean {mean:.1f}), TTFT p90 {p90 * 1e3:.1f} ms")
