"""`llmsched bench throughput` end to end on the embedded model, and its workload helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmsched.bench.metrics import MetricsCollector
from llmsched.bench.throughput import load_dataset, synthetic_requests
from llmsched.cli import main
from llmsched.core.errors import ConfigError

SMALL = ["--input-len", "64", "--output-len", "6", "--num-prompts", "4", "--disable-tqdm"]


@pytest.mark.parametrize("mode", ["--no-async-scheduling", "--async-scheduling"])
def test_reports_throughput_latencies_and_the_first_steps_decisions(
    use_embedded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    result = tmp_path / "out" / "result.json"
    argv = ["bench", "throughput", *SMALL, "--max-num-batched-tokens", "256", mode]
    rc = main([*argv, "--explain-steps", "2", "--result-json", str(result)])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "RANDOM weights" in err and "RANDOM weights" in out
    # The whole batch fits the 256-token budget: all four run in step 0.
    assert "step 0: 4 requests ran 256 tokens" in out
    assert "step 1: 4 requests ran 4 tokens" in out and "step 2:" not in out
    for label in ("Request throughput (req/s):", "Input token throughput", "Output token throughput"):
        assert label in out
    for label in (
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "P99 TPOT (ms):",
    ):
        assert label in out
    assert "Throughput:" in out and "requests/s" in out
    data = json.loads(result.read_text())
    # The simulator's keys (llmsched.bench.metrics), so results compare across tools.
    assert set(MetricsCollector().summary(1.0)) <= set(data)
    assert (data["completed"], data["failed"]) == (4, 0)
    assert (data["total_input_tokens"], data["total_output_tokens"]) == (256, 24)
    assert data["num_requests"] == 4 and data["elapsed_time"] == data["duration"] > 0
    # A prefill and five decodes; async scheduling plans one more (empty)
    # step while the last token is in flight.
    assert data["engine"]["num_busy_steps"] == 6 and data["engine"]["max_running"] == 4
    assert data["engine"]["num_steps"] == (7 if mode == "--async-scheduling" else 6)
    assert data["random_weights"] is True
    assert 0 < data["mean_ttft_ms"] <= data["mean_e2el_ms"]
    assert data["mean_tpot_ms"] > 0


def test_a_small_budget_shows_why_requests_wait(
    use_embedded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "bench",
            "throughput",
            *SMALL,
            "--max-num-batched-tokens",
            "128",
            "--max-num-seqs",
            "4",
            "--explain-steps",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "step 0: 2 requests ran 128 tokens" in out
    assert "token budget spent" in out


def test_a_dataset_file_with_mixed_prompt_forms(
    use_embedded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = tmp_path / "ds.jsonl"
    lines = [
        {"prompt": "hello world", "output_len": 3},
        {"prompt_token_ids": [65, 66, 67], "max_tokens": 2},
        {"prompt_len": 20},
        {"prompt_len": 5000, "output_len": 2},
    ]
    ds.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    result = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "throughput",
            "--dataset",
            str(ds),
            "--output-len",
            "4",
            "--disable-tqdm",
            "--result-json",
            str(result),
        ]
    )
    out = capsys.readouterr().out
    # The over-long prompt fails alone; the rest complete.
    assert rc == 1
    data = json.loads(result.read_text())
    assert (data["completed"], data["failed"]) == (3, 1)
    assert data["total_output_tokens"] == 3 + 2 + 4
    assert "failed 3:" in out and "max_model_len" in out


def test_synthetic_requests_are_seeded_and_sized() -> None:
    a = synthetic_requests(3, 10, 5, list(range(100, 110)), seed=1)
    b = synthetic_requests(3, 10, 5, list(range(100, 110)), seed=1)
    assert a == b
    assert all(len(r.prompt) == 10 and r.output_len == 5 for r in a)
    assert all(100 <= t < 110 for r in a for t in r.prompt)
    assert synthetic_requests(3, 10, 5, list(range(100, 110)), seed=2) != a


def test_dataset_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_dataset(tmp_path / "none.jsonl", 4, [1, 2])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"output_len": 3}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        load_dataset(bad, 4, [1, 2])
    bad.write_text('{"prompt": "a", "output_len": 0}\n')
    with pytest.raises(ConfigError, match="output_len"):
        load_dataset(bad, 4, [1, 2])
    bad.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match="JSON object"):
        load_dataset(bad, 4, [1, 2])
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    assert [r.prompt for r in load_dataset(good, 4, [1], num_prompts=2)] == ["a", "b"]


def test_a_json_schema_workload_constrains_every_request(
    use_embedded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    result = tmp_path / "r.json"
    argv = ["bench", "throughput", *SMALL, "--json-schema", str(schema), "--result-json", str(result)]
    assert main(argv) == 0
    assert "JSON-schema constrained" in capsys.readouterr().out
    data = json.loads(result.read_text())
    # ignore_eos: each request still produces its whole length after the grammar ends.
    assert (data["completed"], data["total_output_tokens"]) == (4, 24)


def test_json_schema_requests_share_one_compiled_grammar(use_embedded: Path) -> None:
    from llmsched.bench.throughput import BenchRequest, run_throughput, with_json_schema
    from llmsched.engine.args import EngineArgs
    from llmsched.engine.llm_engine import LLMEngine

    schema = {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]}
    reqs = with_json_schema([BenchRequest([65, 66], 8) for _ in range(5)], schema)
    reqs.append(BenchRequest([67], 8, {"type": "objekt"}))
    with LLMEngine(EngineArgs()) as engine:
        res = run_throughput(engine, reqs)
        manager = engine.structured_output_manager
        assert (manager.num_compiled, manager.num_cache_hits) == (1, 4)
    # The bad schema fails its own request only, naming the problem.
    assert [rid for rid, _ in res.rejections] == ["5"]
    assert "not a valid JSON schema" in res.rejections[0][1]
    assert res.summary["completed"] == 5


def test_json_schema_file_errors_are_named(tmp_path: Path) -> None:
    from llmsched.bench.throughput import load_json_schema

    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(ConfigError, match="must be an object"):
        load_json_schema(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_json_schema(tmp_path / "missing.json")


def test_dataset_tenants_are_read_and_checked(tmp_path: Path) -> None:
    ds = tmp_path / "t.jsonl"
    ds.write_text('{"prompt": "a", "tenant": "acme"}\n{"prompt": "b"}\n')
    assert [r.tenant for r in load_dataset(ds, 4, [1])] == ["acme", None]
    ds.write_text('{"prompt": "a", "tenant": 7}\n')
    with pytest.raises(ConfigError, match="tenant must be a string"):
        load_dataset(ds, 4, [1])
