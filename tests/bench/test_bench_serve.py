"""`llmsched bench serve` against a real server: the same result keys as `bench throughput`, exact counts."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from llmsched.bench.metrics import MetricsCollector
from llmsched.bench.serve import arrival_delays
from llmsched.cli import main
from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model behind a real server."""
    with embedded_server(
        EngineArgs(max_model_len=128, num_gpu_blocks_override=512), ServerArgs(log_level="critical")
    ) as s:
        yield s


def test_reports_latencies_and_throughput_under_bench_throughputs_keys(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "res" / "serve.json"
    argv = [
        "bench", "serve", "--base-url", server.base_url, "--num-prompts", "12", "--input-len", "20",
        "--output-len", "8", "--max-concurrency", "4", "--request-rate", "200", "--disable-tqdm",
        "--result-json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    for label in (
        "Serving Benchmark Result",
        "Mean TTFT (ms):",
        "P99 ITL (ms):",
        "Median E2EL (ms):",
        "Server engine steps:",
    ):
        assert label in text
    data = json.loads(out.read_text())
    assert set(MetricsCollector().summary(1.0)) <= set(data)
    assert (data["completed"], data["failed"]) == (12, 0)
    assert (data["total_input_tokens"], data["total_output_tokens"]) == (12 * 20, 12 * 8)
    assert data["max_concurrency"] == 4 and data["request_throughput"] > 0
    assert 0 < data["mean_ttft_ms"] <= data["mean_e2el_ms"]
    assert data["mean_tpot_ms"] > 0 and data["mean_itl_ms"] > 0
    assert data["engine"]["generation_tokens"] == 12 * 8 and data["engine"]["num_steps"] > 0


def test_failures_are_counted_and_the_exit_code_says_so(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fail.json"
    # 200 prompt tokens do not fit a 128-token context: every request gets a 400.
    argv = [
        "bench", "serve", "--base-url", server.base_url, "--num-prompts", "3", "--input-len", "200",
        "--output-len", "4", "--disable-tqdm", "--result-json", str(out),
    ]  # fmt: skip
    assert main(argv) == 1
    assert "HTTP 400" in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert (data["completed"], data["failed"]) == (0, 3)
    assert len(data["errors"]) == 3


def test_poisson_arrivals_are_seeded_and_inf_sends_at_once() -> None:
    assert arrival_delays(4, math.inf, 0) == [0.0] * 4
    gaps = arrival_delays(2000, 50.0, 1)
    assert gaps == arrival_delays(2000, 50.0, 1) != arrival_delays(2000, 50.0, 2)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.1)


# What `vllm bench serve --save-result` writes (vLLM 0.33, default percentiles 99 of ttft/tpot/itl).
VLLM_RESULT_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl")),
}  # fmt: skip


def test_vllm_dataset_flags_and_result_layout(server: ServerThread, tmp_path: Path) -> None:
    argv = [
        "bench", "serve", "--backend", "vllm", "--base-url", server.base_url, "--dataset-name", "random",
        "--random-input-len", "16", "--random-output-len", "6", "--num-prompts", "5", "--seed", "3",
        "--ignore-eos", "--request-rate", "100", "--burstiness", "0.5", "--disable-tqdm", "--save-result",
        "--result-dir", str(tmp_path), "--save-detailed",
    ]  # fmt: skip
    assert main(argv) == 0
    (out,) = tmp_path.glob("vllm-100qps-model-*.json")
    data = json.loads(out.read_text())
    assert set(data) >= VLLM_RESULT_KEYS
    assert (data["backend"], data["request_rate"], data["burstiness"]) == ("vllm", 100.0, 0.5)
    assert (data["total_input_tokens"], data["total_output_tokens"]) == (5 * 16, 5 * 6)
    assert data["input_lens"] == [16] * 5 and data["output_lens"] == [6] * 5
    # One gap per streamed chunk after the first (a chunk may carry several tokens).
    assert len(data["itls"]) == 5 and all(1 <= len(x) <= 5 for x in data["itls"])


def test_random_dataset_name_refuses_a_dataset_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt_len": 4}\n')
    argv = [
        "bench",
        "serve",
        "--base-url",
        "http://127.0.0.1:1",
        "--dataset-name",
        "random",
        "--dataset-path",
        str(f),
    ]
    assert main(argv) == 2
    assert "--dataset-name random" in capsys.readouterr().err


def test_bursty_arrivals_keep_the_mean_rate() -> None:
    gaps = arrival_delays(4000, 20.0, 1, burstiness=0.5)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    assert gaps != arrival_delays(4000, 20.0, 1)
