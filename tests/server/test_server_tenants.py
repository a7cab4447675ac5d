"""The OpenAI ``user`` field as tenant: the fair policy over HTTP and per-tenant /metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread
from llmsched.server.tenant_metrics import OTHER_TENANTS, TenantMetrics


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model under the fair policy."""
    engine = EngineArgs(
        max_model_len=128,
        num_gpu_blocks_override=512,
        scheduling_policy="fair+skip-admission",
        policy_config={"output_weight": 1.0},
    )
    with embedded_server(engine, ServerArgs(log_level="critical")) as s:
        yield s


def complete(server: ServerThread, user: str | None) -> dict:
    """One completion of 3 tokens, sent as ``user``."""
    body: dict = {"prompt": "hello tenant", "max_tokens": 3, "ignore_eos": True}
    if user is not None:
        body["user"] = user
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokens_and_queue_time_are_reported_per_tenant(server: ServerThread) -> None:
    a = complete(server, "alice")
    complete(server, "alice")
    complete(server, "bob")
    complete(server, None)
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    gen = {s.labels["tenant"]: s.value for s in fams["llmsched:tenant_generation_tokens"].samples}
    prompt = {s.labels["tenant"]: s.value for s in fams["llmsched:tenant_prompt_tokens"].samples}
    assert gen["alice"] == 6 and gen["bob"] == 3 and gen["none"] == 3
    assert prompt["alice"] == 2 * a["usage"]["prompt_tokens"]
    counts = {
        s.labels["tenant"]: s.value
        for s in fams["llmsched:tenant_queue_time_seconds"].samples
        if s.name.endswith("_count")
    }
    assert counts["alice"] == 2 and counts["bob"] == 1


def test_priority_is_accepted_under_a_priority_policy_only() -> None:
    from llmsched.core.policies import uses_priority

    assert uses_priority("priority-preemptive") and uses_priority("priority+skip-admission")
    assert not uses_priority("fair") and not uses_priority("fcfs")


def test_the_tenant_label_set_is_bounded() -> None:
    m = TenantMetrics(max_labels=2)
    for t in ("a", "b", "c", "d", "a"):
        m.on_tokens(t, 1, 1)
    assert set(m.prompt_tokens) == {"a", "b", OTHER_TENANTS}
    assert m.prompt_tokens["a"] == 2 and m.prompt_tokens[OTHER_TENANTS] == 2
