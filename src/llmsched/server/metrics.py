"""The server's Prometheus metrics, under vLLM's names wherever vLLM has the same metric.

Naming policy: a metric that means what a vLLM metric means carries the
vLLM name exactly (``vllm:`` prefix, the same labels ``model_name`` and
``engine``), so dashboards and alerts written for vLLM work unchanged
against llmsched. Metrics vLLM does not have are ``llmsched:``-prefixed, so
nobody mistakes them for vLLM's. Counters are declared without ``_total``;
the exposition adds it (``vllm:num_preemptions_total``), as vLLM's do.

Scheduler figures (queue sizes, KV usage, preemptions, prefix-cache
lookups) are read from the engine's latest snapshot at scrape time; request
figures (tokens, latencies, finishes) are counted on the event loop as
outputs arrive, from the engine's own timestamps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmsched.server.admission import REASON_REQUESTS, REASON_TOKENS, AdmissionControl
from llmsched.server.engine_messages import EngineSnapshot, OutputDelta
from llmsched.server.prom import Histogram, token_buckets
from llmsched.server.request_stream import RequestStream

# Bucket bounds as vLLM's defaults (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """Counts what the server does; ``render()`` gives the Prometheus text exposition."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        snapshot: Callable[[], EngineSnapshot],
        admission: Callable[[], AdmissionControl],
    ) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self._snapshot = snapshot
        self._admission = admission
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected = {REASON_REQUESTS: 0, REASON_TOKENS: 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(token_buckets(max_model_len))
        self.request_generation_tokens = Histogram(token_buckets(max_model_len))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ---- updates (event loop) ----------------------------------------------

    def on_output(self, stream: RequestStream, out: OutputDelta, token_time: float) -> None:
        """Count one output's tokens and latencies; a final one also counts the request."""
        num_new = len(out.token_ids)
        if num_new:
            if stream.num_tokens == 0:
                self.ttft.observe(token_time - stream.arrival_time)
                # As vLLM: prompt tokens count once the prefill produced a token.
                self.prompt_tokens += stream.prompt_len
            else:
                self.itl.observe(token_time - stream.last_token_time)
            stream.last_token_time = token_time
            stream.num_tokens += num_new
            self.generation_tokens += num_new
        if not out.finished:
            return
        reason = out.finish_reason or "abort"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if out.final is not None:
            arrival, first_scheduled, finished, tpot, num_generated = out.final
            if math.isfinite(finished):
                self.e2e.observe(finished - arrival)
            if math.isfinite(first_scheduled):
                self.queue_time.observe(first_scheduled - arrival)
            if num_generated > 1:
                self.tpot.observe(tpot)
        self.request_prompt_tokens.observe(stream.prompt_len)
        self.request_generation_tokens.observe(stream.num_tokens)

    def on_rejected(self, reason: str) -> None:
        """Count a request refused by a queue limit."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    # ---- exposition ------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector hook."""
        names = list(self.labels)
        values = list(self.labels.values())
        snap = self._snapshot()
        adm = self._admission()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", snap.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", snap.num_waiting
        )
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", snap.kv_usage)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            snap.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            snap.prefix_cache_hits,
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", snap.num_preemptions
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason, n in self.finished.items():
            success.add_metric([*values, reason], n)
        yield success
        rejected = CounterMetricFamily(
            "llmsched:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=["model_name", "reason"],
        )
        for reason, n in self.rejected.items():
            rejected.add_metric([self.labels["model_name"], reason], n)
        yield rejected
        hists = (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
            (
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                self.tpot,
            ),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                self.queue_time,
            ),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", self.request_prompt_tokens),
            (
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                self.request_generation_tokens,
            ),
        )
        for name, doc, h in hists:
            yield h.family(name, doc, self.labels)
        yield counter("llmsched:engine_steps", "Engine steps run.", snap.num_steps)
        yield gauge(
            "llmsched:kv_cache_free_blocks",
            "KV cache blocks free (cached ones included).",
            snap.num_free_blocks,
        )
        yield gauge(
            "llmsched:kv_cache_usable_blocks", "KV cache blocks that can hold tokens.", snap.num_usable_blocks
        )
        yield gauge(
            "llmsched:num_requests_in_flight",
            "Requests the server holds (queued, running or awaiting admission); capped by "
            "--max-num-queued-requests.",
            adm.num_requests,
        )
        yield gauge(
            "llmsched:num_queued_prompt_tokens",
            "Prompt tokens of requests without a first token yet; capped by --max-num-queued-tokens.",
            adm.num_queued_tokens,
        )
