"""The published-runs corpus is complete and sourced; a point becomes the right `llmsched simulate` run."""

from __future__ import annotations

import copy
import json

import pytest
from sim_vs_published import CORPUS, check_file, load_corpus, run_simulate, simulate_args

from llmsched.executor.sim.hardware import known_hardware
from llmsched.executor.sim.model_shapes import known_models


def test_every_point_has_its_fields_a_source_and_a_model_and_gpu_the_simulator_knows() -> None:
    points = load_corpus()
    assert len(points) >= 6
    assert len({p["deployment"]["sim_hardware"] for p in points}) >= 2
    assert len({p["deployment"]["sim_model"] for p in points}) >= 2
    for p in points:
        src = p["source"]
        assert src["url"].startswith("https://github.com/") and src["commit"] in src["url"]
        assert len(src["commit"]) == 40
        assert p["deployment"]["sim_model"] in known_models()
        assert p["deployment"]["sim_hardware"] in known_hardware()
        assert p["deployment"]["serve_command"].startswith("vllm serve ")
        assert p["bench_command"].startswith("vllm bench serve ")


def test_every_file_says_what_its_source_leaves_unknown() -> None:
    for path in sorted(CORPUS.glob("*.json")):
        data = json.loads(path.read_text())
        assert check_file(data, path.name) == []
        assert data["unknowns"], path.name


def test_a_point_missing_a_figure_or_its_source_is_named() -> None:
    path = sorted(CORPUS.glob("gpustack-*.json"))[0]
    data = json.loads(path.read_text())
    broken = copy.deepcopy(data)
    del broken["source"]["commit"]
    del broken["points"][0]["reported"]["median_tpot_ms"]
    del broken["points"][0]["reported"]["mean_tpot_ms"]
    problems = check_file(broken, path.name)
    assert any("'commit'" in m for m in problems)
    assert any("reports no tpot_ms" in m for m in problems)


def _opts(args: list[str]) -> dict[str, str]:
    """Each --option of an argument list with its value ("" for a bare flag)."""
    out: dict[str, str] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else "--"
            out[a] = "" if nxt.startswith("--") else nxt
    return out


def _point(point_id: str) -> dict:
    return next(p for p in load_corpus() if p["id"] == point_id)


def test_a_gpustack_point_becomes_vllm_0_11_serve_defaults_on_one_a100() -> None:
    p = _point("gpustack-qwen3-14b-a100-random-4000-200")
    args = simulate_args(p, 42)
    opts = _opts(args)
    assert args[0] == "simulate"
    assert "--no-async-scheduling" in args  # opt-in in vLLM 0.11
    assert opts["--model"] == "qwen3-14b" and opts["--hardware"] == "a100"
    assert opts["--tensor-parallel-size"] == "1"
    # vLLM's `serve` batch defaults on an A100, not the H100-class ones.
    assert opts["--max-num-batched-tokens"] == "2048" and opts["--max-num-seqs"] == "256"
    assert opts["--max-model-len"] == "40960" and opts["--gpu-memory-utilization"] == "0.9"
    # 99,783 tokens generated over 500 requests: 200 is the nominal length, 200 the mean too.
    assert opts["--input-len"] == "4000" and opts["--output-len"] == "200"
    assert opts["--num-prompts"] == "500" and opts["--request-rate"] == "inf" and opts["--seed"] == "42"
    assert "--max-concurrency" not in args


def test_outputs_cut_short_by_eos_are_simulated_at_the_reported_mean() -> None:
    p = _point("gpustack-qwen3-32b-a100-random-32000-100")
    args = simulate_args(p, 42)
    opts = _opts(args)
    assert p["reported"]["total_generated_tokens"] == 7699
    assert opts["--output-len"] == "77" and opts["--max-model-len"] == "32768"


def test_a_kvcached_point_runs_async_at_its_rate_and_a_short_simulation_reports_its_figures() -> None:
    p = _point("kvcached-qwen3-0.6b-h100-random-512-128-rate16")
    args = simulate_args(p, 7)
    assert "--async-scheduling" in args and "--no-async-scheduling" not in args
    opts = _opts(args)
    assert opts["--request-rate"] == "16" and opts["--gpu-memory-utilization"] == "0.5"
    assert opts["--max-model-len"] == "2048" and opts["--seed"] == "7"
    short = [*args]
    short[short.index("--num-prompts") + 1] = "20"
    result = run_simulate(short)
    assert result["completed"] == 20
    assert result["median_tpot_ms"] > 0 and result["median_ttft_ms"] > 0


def test_a_non_random_dataset_is_refused() -> None:
    p = copy.deepcopy(_point("gpustack-qwen3-14b-h100-random-2000-100"))
    p["workload"]["dataset"] = "sharegpt"
    with pytest.raises(ValueError, match="only random-dataset points"):
        simulate_args(p, 42)


def test_each_point_goes_through_the_api_servers_its_vllm_serve_ran_at_its_endpoint_cost() -> None:
    from llmsched.sim.frontend import CHAT_REQUEST_S, DEFAULT_REQUEST_S

    chat = simulate_args(_point("gpustack-qwen3-14b-h100-random-128-4"), 42)
    plain = simulate_args(_point("kvcached-qwen3-0.6b-h100-random-512-128-inf"), 42)
    # `vllm serve` without --api-server-count runs one; GPUStack benchmarked the chat endpoint.
    assert _opts(chat)["--api-server-count"] == "1" and _opts(plain)["--api-server-count"] == "1"
    per_request = [float(_opts(a)["--api-server-us-per-request"]) / 1e6 for a in (chat, plain)]
    assert per_request == pytest.approx([CHAT_REQUEST_S, DEFAULT_REQUEST_S], rel=1e-5)
    engine_only = simulate_args(_point("kvcached-qwen3-0.6b-h100-random-512-128-inf"), 42, frontend=False)
    assert not any(a.startswith("--api-server") for a in engine_only)
