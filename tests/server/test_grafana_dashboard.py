"""The Grafana dashboard under examples/ reads only metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from llmsched.server.admission import AdmissionControl
from llmsched.server.engine_messages import EngineSnapshot
from llmsched.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "llmsched-dashboard.json"
METRIC = re.compile(r"\b((?:vllm|llmsched):[A-Za-z0-9_:]+)")


def exported_sample_names() -> set[str]:
    """Every sample name /metrics shows (``_bucket``, ``_sum``, ``_total`` ... included)."""
    snap = EngineSnapshot(num_waiting=1, waiting_by_reason=(("queued_behind", 1),))
    metrics = ServerMetrics(
        "m", 1024, lambda: snap, lambda: AdmissionControl(8, None), cache_config={}, kv_cache_metrics=True
    )
    names = set()
    for line in metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def queries(node: object) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and template variable queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(queries(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(queries(item))
    return found


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    assert len(exprs) >= 20
    exported = exported_sample_names()
    unknown = sorted({m for e in exprs for m in METRIC.findall(e)} - exported)
    assert not unknown, f"the dashboard reads metrics the server does not export: {unknown}"
    # Each panel query names at least one metric (no constant panels).
    assert all(METRIC.search(e) for e in exprs)


def test_the_dashboard_covers_the_metrics_vllms_dashboards_read() -> None:
    text = DASHBOARD.read_text()
    for name in (
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket",
        "vllm:iteration_tokens_total_bucket",
        "vllm:num_requests_waiting_by_reason",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert name in text, name
