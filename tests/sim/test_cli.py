"""`llmsched simulate` end to end: table, JSON keys, trace, plots, and bad input."""

from __future__ import annotations

import json

import pytest

from llmsched.cli import main

VLLM_KEYS = [
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    *[
        f"{s}_{m}_ms"
        for m in ("ttft", "tpot", "itl", "e2el")
        for s in ("mean", "median", "std", "p50", "p90", "p99")
    ],
]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", "--disable-tqdm", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_end_to_end(tmp_path, capsys):
    # Output folders that do not exist yet are created.
    rj, trace, plot = tmp_path / "new" / "r.json", tmp_path / "t.jsonl", tmp_path / "fig"
    code, out, _ = run(
        capsys,
        "--model", "qwen3-0.6b", "--hardware", "h100",
        "--num-prompts", "120", "--input-len", "300", "--output-len", "20", "--request-rate", "50",
        "--max-num-seqs", "32", "--max-num-batched-tokens", "1024", "--no-enable-prefix-caching",
        "--goodput-ttft-ms", "100", "--goodput-tpot-ms", "20",
        "--result-json", str(rj), "--trace", str(trace), "--plot", str(plot),
    )  # fmt: skip
    assert code == 0
    for row in (
        "Simulation Result",
        "Successful requests:                     120",
        "Request throughput (req/s):",
        "Request goodput (req/s):",
        "Input token throughput (tok/s):",
        "Output token throughput (tok/s):",
        "Mean TTFT (ms):",
        "P99 TPOT (ms):",
        "P90 ITL (ms):",
        "Median E2EL (ms):",
        "Preemptions:",
        "Prefix cache hit rate (%):",
        "qwen3-0.6b",
        "prefix caching off",
    ):
        assert row in out, row
    data = json.loads(rj.read_text())
    for key in VLLM_KEYS:
        assert key in data, key
    assert data["completed"] == 120 and data["total_output_tokens"] == 120 * 20
    assert data["request_goodput"] is not None
    assert data["goodput_slos_ms"] == {"ttft": 100.0, "tpot": 20.0}
    assert data["deployment"]["scheduler"]["max_num_seqs"] == 32
    assert data["deployment"]["scheduler"]["enable_prefix_caching"] is False
    lines = trace.read_text().splitlines()
    assert "header" in json.loads(lines[0])
    steps = [json.loads(x) for x in lines[1:]]
    assert len(steps) == data["simulation"]["num_steps"]
    for key in ("sched", "admitted", "preempted", "finished", "total_tokens", "kv_usage", "sim_duration_s"):
        assert key in steps[0]
    assert sum(s["sim_duration_s"] for s in steps) <= data["duration"]
    for name in ("timeline", "tokens", "latency_cdf"):
        assert (tmp_path / f"fig_{name}.png").stat().st_size > 10_000


def test_dataset_trace_and_vllm_style_goodput(tmp_path, capsys):
    ds = tmp_path / "trace.jsonl"
    ds.write_text(
        "\n".join(
            json.dumps({"arrival_time": i * 0.1, "prompt_len": 50 + i, "output_len": 5}) for i in range(30)
        )
    )
    rj = tmp_path / "r.json"
    code, out, _ = run(
        capsys, "--dataset", str(ds), "--goodput", "ttft:500", "e2el:2000", "--result-json", str(rj),
        "--scheduling-policy", "priority", "--save-detailed",
    )  # fmt: skip
    assert code == 0
    data = json.loads(rj.read_text())
    assert data["completed"] == 30 and data["goodput_slos_ms"] == {"ttft": 500.0, "e2el": 2000.0}
    assert data["input_lens"] == [50 + i for i in range(30)]
    assert data["start_times"] == pytest.approx([i * 0.1 for i in range(30)])
    assert "trace.jsonl" in out


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--model", "gpt-17"], ["unknown model 'gpt-17'", "llama-3-8b", "qwen3-32b", "deepseek-v3"]),
        (["--hardware", "tpu"], ["unknown hardware 'tpu'", "a100", "b200", "cpu", "h100", "h200"]),
        (["--model", "llama-3-70b"], ["does not fit on 1x h100", "131.42 GiB of weights"]),
        (["--model", "qwen3-32b", "--hardware", "a100"], ["max_model_len=40960 needs", "GiB of KV cache"]),
        (["--max-model-len", "100000"], ["greater than the model's maximum context length"]),
        (["--efficiency", "gemm=2"], ["efficiency gemm=2.0 must be in (0, 1]"]),
        (["--goodput", "speed:1"], ["--goodput"]),
        (["--dataset", "/nonexistent.jsonl"], ["does not exist"]),
        (["--tensor-parallel-size", "3"], ["must divide the number of attention heads"]),
        (["--cuda-graph-max-tokens", "-1"], ["cuda_graph_max_tokens=-1 must be >= 0"]),
        (["--launch-latency-us", "-2"], ["launch_latency_us=-2.0 must be >= 0"]),
    ],
)
def test_bad_input_fails_before_simulating(capsys, argv, needles):
    code, out, err = run(capsys, "--num-prompts", "5", *argv)
    assert code == 2
    assert "Simulation Result" not in out
    for needle in needles:
        assert needle in err, needle


def test_tensor_parallel_big_model(capsys):
    code, out, _ = run(
        capsys, "--model", "qwen3-32b", "--tensor-parallel-size", "8", "--max-model-len", "8192",
        "--num-prompts", "20", "--input-len", "200", "--output-len", "4",
    )  # fmt: skip
    assert code == 0
    assert "8x NVIDIA H100" in out and "TP=8" in out


def test_cpu_hardware_uses_the_calibration(tmp_path, monkeypatch, capsys):
    from llmsched.sim import calibrate

    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(tmp_path))
    fake = {"backend": "numpy", "peak_flops": 5e10, "mem_bandwidth": 2e10, "mem_capacity": 32 * 2**30}
    fake.update(seconds=0.1, measured_at="now", settled=True)
    monkeypatch.setattr(calibrate, "measure", lambda: dict(fake))
    code, out, _ = run(
        capsys, "--hardware", "cpu", "--model", "qwen3-0.6b", "--max-model-len", "2048",
        "--num-prompts", "4", "--input-len", "64", "--output-len", "4",
    )  # fmt: skip
    assert code == 0
    assert "calibrated with numpy" in out
    # vLLM's CPU serving defaults: 2048 batched tokens, 128 sequences.
    assert "max_num_batched_tokens 2048, max_num_seqs 128" in out
    assert (tmp_path / calibrate.CACHE_FILE).is_file()


def test_launch_flags_reach_the_cost_model(tmp_path, capsys):
    rj = tmp_path / "r.json"
    # Sync: a step pays its launches on top of its kernels (the async case is below).
    common = [
        "--model", "qwen3-0.6b", "--num-prompts", "16", "--input-len", "64", "--output-len", "16",
        "--no-async-scheduling",
    ]  # fmt: skip
    code, out, _ = run(capsys, *common, "--result-json", str(rj))
    assert code == 0
    assert "CUDA graphs up to 512 tokens, 5 us per launch" in out
    graphs = json.loads(rj.read_text())
    code, out, _ = run(
        capsys, *common, "--cuda-graph-max-tokens", "0", "--launch-latency-us", "20",
        "--kernels-per-layer", "12", "--result-json", str(rj),
    )  # fmt: skip
    assert code == 0
    assert "no CUDA graphs, 20 us per launch" in out
    eager = json.loads(rj.read_text())
    launch = eager["deployment"]["launch"]
    assert launch["cuda_graph_max_tokens"] == 0 and launch["launch_latency_us"] == pytest.approx(20.0)
    assert launch["eager_launches_per_step"] == 28 * 12
    # Every decode step now pays 28 layers x 12 launches x 20 us = 6.72 ms more.
    assert eager["mean_tpot_ms"] - graphs["mean_tpot_ms"] == pytest.approx(6.72, rel=0.01)


def test_async_scheduling_is_on_by_default_and_overlaps_the_launches(tmp_path, capsys):
    rj = tmp_path / "r.json"
    common = ["--model", "qwen3-0.6b", "--num-prompts", "16", "--input-len", "64", "--output-len", "16"]
    common += ["--hardware", "h100-roofline"]  # the model time these figures were recorded with
    eager = ["--cuda-graph-max-tokens", "0", "--launch-latency-us", "20", "--kernels-per-layer", "12"]
    code, out, _ = run(capsys, *common, *eager, "--result-json", str(rj))
    assert code == 0
    assert "async scheduling on" in out and "Async scheduling:                        on" in out
    on = json.loads(rj.read_text())
    assert on["deployment"]["scheduler"]["async_scheduling"] is True
    assert on["simulation"]["async_scheduling"] is True
    costs = on["simulation"]["step_costs"]
    # 16 decodes: host path 0.5 ms + 6.72 ms of launches, far above the model's time,
    # so every step after the first costs its host path, and the device waits the rest.
    assert costs["mean_model_ms"] < 1.0 < 7.0 < costs["mean_host_ms"] < 7.3
    assert on["median_itl_ms"] == pytest.approx(7.22, rel=0.01)
    assert costs["median_host_gap_ms"] == pytest.approx(7.22 - costs["mean_model_ms"], rel=0.05)
    code, out, _ = run(capsys, *common, *eager, "--no-async-scheduling", "--result-json", str(rj))
    assert code == 0
    assert "async scheduling off" in out
    off = json.loads(rj.read_text())
    assert off["simulation"]["async_scheduling"] is False
    assert off["median_itl_ms"] == pytest.approx(7.22 + costs["mean_model_ms"], rel=0.02)
    assert off["simulation"]["step_costs"]["median_host_gap_ms"] == pytest.approx(
        costs["mean_host_ms"], rel=0.02
    )
    assert on["output_throughput"] > off["output_throughput"]


def test_async_scheduling_with_data_parallel_ranks_is_refused(capsys):
    code, out, err = run(
        capsys,
        "--model",
        "qwen3-30b-a3b",
        "--data-parallel-size",
        "2",
        "--async-scheduling",
        "--num-prompts",
        "4",
    )
    assert code == 2
    assert "--no-async-scheduling" in err and "Simulation Result" not in out
