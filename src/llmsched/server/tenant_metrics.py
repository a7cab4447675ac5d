"""Per-tenant figures for /metrics, under a bounded set of tenant labels.

Tenants come from the OpenAI ``user`` field, which any client can set, so the
label set is capped: the first ``MAX_TENANT_LABELS`` distinct tenants get a
label of their own, later ones share ``other``, requests without one ``none``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from llmsched.server.prom import Histogram

MAX_TENANT_LABELS = 32
NO_TENANT = "none"
OTHER_TENANTS = "other"
QUEUE_TIME_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]


class TenantMetrics:
    """Tokens served and queue time, by tenant label."""

    def __init__(self, max_labels: int = MAX_TENANT_LABELS) -> None:
        self.max_labels = max_labels
        self.prompt_tokens: dict[str, int] = {}
        self.generation_tokens: dict[str, int] = {}
        self.queue_time: dict[str, Histogram] = {}

    def label(self, tenant: str | None) -> str:
        """The label ``tenant`` is counted under."""
        if tenant is None:
            return NO_TENANT
        if tenant in self.prompt_tokens or len(self.prompt_tokens) < self.max_labels:
            return tenant
        return OTHER_TENANTS

    def _slot(self, label: str) -> None:
        if label not in self.prompt_tokens:
            self.prompt_tokens[label] = 0
            self.generation_tokens[label] = 0
            self.queue_time[label] = Histogram(QUEUE_TIME_BUCKETS)

    def on_tokens(self, tenant: str | None, prompt: int, generated: int) -> None:
        """Count tokens served to ``tenant``."""
        label = self.label(tenant)
        self._slot(label)
        self.prompt_tokens[label] += prompt
        self.generation_tokens[label] += generated

    def on_queue_time(self, tenant: str | None, seconds: float) -> None:
        """Record how long a request of ``tenant`` waited for its first scheduling."""
        label = self.label(tenant)
        self._slot(label)
        self.queue_time[label].observe(seconds)

    def families(self, model_name: str) -> Iterator[Metric]:
        """The Prometheus families."""
        for name, doc, values in (
            ("llmsched:tenant_prompt_tokens", "Prompt tokens served, by tenant.", self.prompt_tokens),
            ("llmsched:tenant_generation_tokens", "Tokens generated, by tenant.", self.generation_tokens),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name", "tenant"])
            for label, v in values.items():
                c.add_metric([model_name, label], v)
            yield c
        fam = HistogramMetricFamily(
            "llmsched:tenant_queue_time_seconds",
            "Time requests waited before first being scheduled, by tenant.",
            labels=["model_name", "tenant"],
        )
        for label, h in self.queue_time.items():
            cumulative = 0
            buckets = []
            for bound, c in zip(h.bounds, h.counts):
                cumulative += c
                buckets.append((repr(float(bound)), cumulative))
            buckets.append(("+Inf", h.count))
            fam.add_metric([model_name, label], buckets, h.sum)
        yield fam
