"""/metrics against vLLM 0.33's own metric list: names, types and label names, then values that add up."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "vllm_0_33_metrics.json").read_text())["metrics"]
# What vLLM's dashboards read, including every name this server once lacked.
REQUIRED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:prompt_tokens_cached", "vllm:generation_tokens", "vllm:request_success",
    "vllm:admission_rejections", "vllm:cache_config_info",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
    "vllm:request_params_max_tokens", "vllm:request_params_n", "vllm:request_max_num_generation_tokens",
    "vllm:request_num_preemptions", "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds", "vllm:kv_block_reuse_gap_seconds",
]  # fmt: skip
PREFIX = "The quick brown fox jumps over the lazy dog; " * 2
MAX_TOKENS = (3, 5, 7, 9)


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """A small KV cache (so blocks get evicted) with every block life sampled."""
    engine_args = EngineArgs(max_model_len=256, num_gpu_blocks_override=40, max_num_seqs=4, block_size=16)
    args = ServerArgs(
        log_level="warning", engine_mode="thread", kv_cache_metrics=True, kv_cache_metrics_sample=1.0
    )
    with embedded_server(engine_args, args) as s:
        for i, n in enumerate(MAX_TOKENS):
            # Shared prefix: the later ones hit the first one's blocks.
            complete(s, PREFIX + f"#{i}", n)
        for i in range(3):
            # Long, distinct prompts: they need the cached blocks back, evicting them.
            complete(s, f"{i} evict " * 24, 2)
        yield s


def complete(server: ServerThread, prompt: str, max_tokens: int) -> dict:
    """One greedy completion of exactly ``max_tokens`` tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def scrape(server: ServerThread) -> dict:
    """name -> parsed family."""
    text = httpx.get(server.base_url + "/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def label_names(family: object) -> set[str]:
    """The label names the family's samples carry (bucket bounds aside)."""
    return {k for s in family.samples for k in s.labels if k != "le"}  # type: ignore[attr-defined]


def test_every_vllm_metric_matches_vllm_name_type_and_labels(server: ServerThread) -> None:
    families = scrape(server)
    ours = {name: f for name, f in families.items() if name.startswith("vllm:")}
    missing = [n for n in REQUIRED if n not in ours]
    assert not missing, f"not exported: {missing}"
    for name, fam in ours.items():
        ref = REFERENCE.get(name)
        assert ref is not None, f"{name} is not a vLLM 0.33 metric; it should be llmsched:-prefixed"
        assert fam.type == ref["type"], f"{name}: {fam.type} != vLLM's {ref['type']}"
        if not fam.samples:
            continue
        labels = label_names(fam)
        if ref.get("labels_subset"):
            assert labels <= set(ref["labels"]) and "engine" in labels, (name, labels - set(ref["labels"]))
        else:
            assert labels == set(ref["labels"]), f"{name}: labels {sorted(labels)} != vLLM's {ref['labels']}"


def test_non_vllm_metrics_carry_the_llmsched_prefix(server: ServerThread) -> None:
    for name in scrape(server):
        assert name.startswith(("vllm:", "llmsched:", "python_", "process_")), name


def sample(families: dict, name: str, suffix: str, **labels: str) -> float:
    """One sample's value."""
    for s in families[name].samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no {name}{suffix} {labels}")


def test_the_new_request_metrics_add_up(server: ServerThread) -> None:
    f = scrape(server)
    finished = len(MAX_TOKENS) + 3
    for name in (
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_num_preemptions",
        "vllm:request_params_n",
    ):
        assert sample(f, name, "_count") == finished, name
    assert sample(f, "vllm:request_params_max_tokens", "_sum") == sum(MAX_TOKENS) + 3 * 2
    assert sample(f, "vllm:request_max_num_generation_tokens", "_sum") == sum(MAX_TOKENS) + 3 * 2
    assert sample(f, "vllm:request_params_n", "_sum") == finished
    # Each phase is part of the whole: inference = prefill + decode.
    inference = sample(f, "vllm:request_inference_time_seconds", "_sum")
    parts = sample(f, "vllm:request_prefill_time_seconds", "_sum") + sample(
        f, "vllm:request_decode_time_seconds", "_sum"
    )
    assert inference == pytest.approx(parts, rel=1e-6)
    # Every prompt and generated token went through some step.
    step_tokens = sample(f, "vllm:iteration_tokens_total", "_sum")
    assert sample(f, "vllm:iteration_tokens_total", "_count") >= 1
    assert (
        step_tokens
        >= sample(f, "vllm:generation_tokens", "_total")
        + sample(f, "vllm:prompt_tokens", "_total")
        - sample(f, "vllm:prompt_tokens_cached", "_total")
        - finished
    )
    # The shared prefix was served from the cache, as vllm:prefix_cache_hits says too.
    cached = sample(f, "vllm:prompt_tokens_cached", "_total")
    assert cached > 0 and cached <= sample(f, "vllm:prefix_cache_hits", "_total")


def test_kv_residency_and_cache_config(server: ServerThread) -> None:
    f = scrape(server)
    assert sample(f, "vllm:kv_block_lifetime_seconds", "_count") > 0
    assert sample(f, "vllm:kv_block_idle_before_evict_seconds", "_count") == sample(
        f, "vllm:kv_block_lifetime_seconds", "_count"
    )
    assert sample(f, "vllm:kv_block_lifetime_seconds", "_sum") >= sample(
        f, "vllm:kv_block_idle_before_evict_seconds", "_sum"
    )
    # The prefix hits revived cached blocks, so some block was accessed twice or more.
    assert sample(f, "vllm:kv_block_reuse_gap_seconds", "_count") > 0
    info = f["vllm:cache_config_info"].samples[0]
    assert info.value == 1
    assert info.labels["num_gpu_blocks"] == "40" and info.labels["enable_prefix_caching"] == "True"


def test_waiting_by_reason_sums_to_the_waiting_gauge(server: ServerThread) -> None:
    f = scrape(server)
    total = sum(s.value for s in f["vllm:num_requests_waiting_by_reason"].samples)
    assert total == sample(f, "vllm:num_requests_waiting", "")
