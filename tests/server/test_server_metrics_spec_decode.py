"""The spec-decode counters on /metrics, under vLLM's names and labels, adding up."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

K = 3


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    engine_args = EngineArgs(max_model_len=256, max_num_seqs=4, speculative_config=spec)
    with embedded_server(engine_args, ServerArgs(log_level="warning", engine_mode="thread")) as s:
        for prompt in ("a b c a b c a b c a b", "one two one two one two"):
            body = {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
            r = httpx.post(s.base_url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        yield s


def test_spec_decode_counters(server: ServerThread) -> None:
    text = httpx.get(server.base_url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    values = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        fam = fams[f"vllm:spec_decode_{name}"]
        assert fam.type == "counter"
        (s,) = [s for s in fam.samples if s.name.endswith("_total")]
        assert set(s.labels) == {"model_name", "engine"}
        values[name] = s.value
    per_pos = fams["vllm:spec_decode_num_accepted_tokens_per_pos"]
    pos = {s.labels["position"]: s.value for s in per_pos.samples if s.name.endswith("_total")}
    assert set(pos) == {str(p) for p in range(K)}
    assert values["num_drafts"] > 0
    assert values["num_drafts"] <= values["num_draft_tokens"] <= K * values["num_drafts"]
    assert 0 < values["num_accepted_tokens"] <= values["num_draft_tokens"]
    # Each accepted token is accepted at one position; a position is reached only through the ones before.
    assert sum(pos.values()) == values["num_accepted_tokens"]
    assert pos["0"] >= pos["1"] >= pos["2"]
