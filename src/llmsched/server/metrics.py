"""The server's Prometheus metrics, under vLLM's names wherever vLLM has the same metric.

Naming policy: a metric that means what a vLLM metric means carries the
vLLM name exactly (``vllm:`` prefix, the same labels ``model_name`` and
``engine``, the same buckets), so dashboards and alerts written for vLLM
work unchanged against llmsched. Metrics vLLM does not have are
``llmsched:``-prefixed, so nobody mistakes them for vLLM's. Counters are
declared without ``_total``; the exposition adds it
(``vllm:num_preemptions_total``), as vLLM's do.

Scheduler figures (queue sizes, why requests wait, KV usage, preemptions,
prefix-cache lookups, tokens per step, KV block residency) come with the
engine's snapshots; request figures (tokens, latencies, phases, finishes)
are counted on the event loop as outputs arrive, from the engine's own
timestamps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmsched.server.admission import REASON_REQUESTS, REASON_TOKENS, AdmissionControl
from llmsched.server.engine_messages import EngineSnapshot, OutputDelta
from llmsched.server.metric_buckets import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    KV_RESIDENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TTFT_BUCKETS,
)
from llmsched.server.prom import Histogram, token_buckets
from llmsched.server.request_stream import RequestStream
from llmsched.server.tenant_metrics import TenantMetrics

FINISH_REASONS = ("stop", "length", "abort", "error")

# name -> (help, attribute holding the Histogram)
_REQUEST_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
    (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        "tpot",
    ),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        "queue_time",
    ),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        "inference_time",
    ),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        "prefill_time",
    ),
    (
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        "decode_time",
    ),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "request_prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "request_generation_tokens"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iteration_tokens"),
    (
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        "max_num_generation_tokens",
    ),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "params_n"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", "params_max_tokens"),
    (
        "vllm:request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        "num_preemptions",
    ),
)
_KV_RESIDENCY_HISTOGRAMS = (
    (
        "vllm:kv_block_lifetime_seconds",
        "Histogram of KV cache block lifetime from allocation to eviction. Sampled metrics "
        "(--kv-cache-metrics-sample).",
        "kv_lifetime",
    ),
    (
        "vllm:kv_block_idle_before_evict_seconds",
        "Histogram of idle time before KV cache block eviction. Sampled metrics (--kv-cache-metrics-sample).",
        "kv_idle",
    ),
    (
        "vllm:kv_block_reuse_gap_seconds",
        "Histogram of time gaps between consecutive KV cache block accesses (the latest few per block). "
        "Sampled metrics (--kv-cache-metrics-sample).",
        "kv_reuse_gap",
    ),
)


class ServerMetrics:
    """Counts what the server does; ``render()`` gives the Prometheus text exposition."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        snapshot: Callable[[], EngineSnapshot],
        admission: Callable[[], AdmissionControl],
        *,
        cache_config: dict[str, str] | None = None,
        kv_cache_metrics: bool = False,
        engine: int = 0,
    ) -> None:
        self.labels = {"model_name": model_name, "engine": str(engine)}
        self._snapshot = snapshot
        self._admission = admission
        self.cache_config = dict(cache_config or {})
        self.kv_cache_metrics = kv_cache_metrics
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected = {REASON_REQUESTS: 0, REASON_TOKENS: 0}
        self._make_histograms(max_model_len)
        self.tenants = TenantMetrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def _make_histograms(self, max_model_len: int) -> None:
        tokens = token_buckets(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        for name in ("e2e", "queue_time", "inference_time", "prefill_time", "decode_time"):
            setattr(self, name, Histogram(REQUEST_LATENCY_BUCKETS))
        for name in ("request_prompt_tokens", "request_generation_tokens", "max_num_generation_tokens"):
            setattr(self, name, Histogram(tokens))
        self.params_max_tokens = Histogram(tokens)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.params_n = Histogram(REQUEST_PARAMS_N_BUCKETS)
        self.num_preemptions = Histogram(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.kv_lifetime = Histogram(KV_RESIDENCY_BUCKETS)
        self.kv_idle = Histogram(KV_RESIDENCY_BUCKETS)
        self.kv_reuse_gap = Histogram(KV_RESIDENCY_BUCKETS)

    # ---- updates (event loop) ----------------------------------------------

    def on_output(self, stream: RequestStream, out: OutputDelta, token_time: float) -> None:
        """Count one output's tokens and latencies; a final one also counts the request."""
        num_new = len(out.token_ids)
        if num_new:
            if stream.num_tokens == 0:
                self.ttft.observe(token_time - stream.arrival_time)
                stream.first_token_time = token_time
                # As vLLM: prompt tokens count once the prefill produced a token.
                self.prompt_tokens += stream.prompt_len
                self.prompt_tokens_cached += min(out.num_cached_tokens, stream.prompt_len)
            elif not stream.turn_ended:
                self.itl.observe(token_time - stream.last_token_time)
            stream.turn_ended = False
            stream.last_token_time = token_time
            stream.num_tokens += num_new
            self.generation_tokens += num_new
            self.tenants.on_tokens(
                stream.tenant, stream.prompt_len if stream.num_tokens == num_new else 0, num_new
            )
        if out.finished:
            self._on_finished(stream, out)

    def _on_finished(self, stream: RequestStream, out: OutputDelta) -> None:
        reason = out.finish_reason or "abort"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if out.final is not None:
            arrival, first_scheduled, finished, tpot, num_generated, num_preemptions = out.final
            if math.isfinite(finished):
                self.e2e.observe(finished - arrival)
            if math.isfinite(first_scheduled):
                self.queue_time.observe(first_scheduled - arrival)
                self.tenants.on_queue_time(stream.tenant, first_scheduled - arrival)
                if stream.num_tokens:
                    self.prefill_time.observe(stream.first_token_time - first_scheduled)
                    self.decode_time.observe(stream.last_token_time - stream.first_token_time)
                    self.inference_time.observe(stream.last_token_time - first_scheduled)
            if num_generated > 1:
                self.tpot.observe(tpot)
            self.num_preemptions.observe(num_preemptions)
        self.request_prompt_tokens.observe(stream.prompt_len)
        self.request_generation_tokens.observe(stream.num_tokens)
        self.params_max_tokens.observe(stream.max_tokens)
        group = stream.group
        if group is None:
            self.params_n.observe(1)
            self.max_num_generation_tokens.observe(stream.num_tokens)
        elif group.child_finished(stream.num_tokens):
            # As vLLM: a request with n > 1 counts once, when its last sequence ends.
            self.params_n.observe(group.n)
            self.max_num_generation_tokens.observe(group.max_num_tokens)

    def on_snapshot(self, snap: EngineSnapshot) -> None:
        """Count what a new engine snapshot reports once: the step's tokens, ended block lives."""
        if snap.step_tokens:
            self.iteration_tokens.observe(snap.step_tokens)
        for lifetime, idle, gaps in snap.kv_evictions:
            self.kv_lifetime.observe(lifetime)
            self.kv_idle.observe(idle)
            for gap in gaps:
                self.kv_reuse_gap.observe(gap)

    def on_rejected(self, reason: str) -> None:
        """Count a request refused by a queue limit."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    # ---- exposition ------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector hook."""
        snap = self._snapshot()
        yield from self._scheduler_families(snap)
        yield from self._token_families()
        for name, doc, attr in _REQUEST_HISTOGRAMS:
            yield getattr(self, attr).family(name, doc, self.labels)
        if self.kv_cache_metrics:
            for name, doc, attr in _KV_RESIDENCY_HISTOGRAMS:
                yield getattr(self, attr).family(name, doc, self.labels)
        if snap.spec_decode is not None:
            yield from self._spec_decode_families(snap.spec_decode)
        yield from self._own_families(snap, self._admission())
        yield from self.tenants.families(self.labels["model_name"])

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def _scheduler_families(self, snap: EngineSnapshot) -> Iterator[Metric]:
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", snap.num_running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", snap.num_waiting
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason, in the scheduler's decision-trace vocabulary "
            "(token_budget_spent, max_num_seqs_reached, kv_blocks_short, queued_behind, preempted, ...). "
            "Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*self.labels, "reason"],
        )
        for reason, n in snap.waiting_by_reason:
            by_reason.add_metric([*self.labels.values(), reason], n)
        yield by_reason
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", snap.kv_usage
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            snap.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            snap.prefix_cache_hits,
        )
        yield self._counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
            snap.external_prefix_cache_queries,
        )
        yield self._counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
            snap.external_prefix_cache_hits,
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", snap.num_preemptions
        )
        if snap.encoder_cache is not None:
            yield from self._encoder_families(*snap.encoder_cache)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*self.cache_config, "engine"],
        )
        info.add_metric([*self.cache_config.values(), self.labels["engine"]], 1)
        yield info

    def _encoder_families(self, usage: float, entries: int, hits: int, encoded: int) -> Iterator[Metric]:
        yield self._gauge(
            "llmsched:encoder_cache_usage_perc",
            "Encoder-cache usage (images' embeddings held). 1 means 100 percent usage.",
            usage,
        )
        yield self._gauge(
            "llmsched:encoder_cache_entries", "Encoder outputs held in the encoder cache.", entries
        )
        yield self._counter(
            "llmsched:encoder_cache_hits", "Encoder inputs whose output was found in the encoder cache.", hits
        )
        yield self._counter(
            "llmsched:encoder_inputs_encoded", "Encoder inputs scheduled for encoding.", encoded
        )

    def _token_families(self) -> Iterator[Metric]:
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
        yield self._counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local prefix cache).",
            self.prompt_tokens_cached,
        )
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*self.labels, "finished_reason"],
        )
        for reason, n in self.finished.items():
            success.add_metric([*self.labels.values(), reason], n)
        yield success

    def _spec_decode_families(self, spec: tuple[int, int, int, tuple[int, ...]]) -> Iterator[Metric]:
        drafts, draft_tokens, accepted, per_pos = spec
        yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", draft_tokens)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", accepted)
        by_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*self.labels, "position"],
        )
        for pos, n in enumerate(per_pos):
            by_pos.add_metric([*self.labels.values(), str(pos)], n)
        yield by_pos

    def _own_families(self, snap: EngineSnapshot, adm: AdmissionControl) -> Iterator[Metric]:
        rejected = CounterMetricFamily(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=["model_name", "reason"],
        )
        for reason, n in self.rejected.items():
            rejected.add_metric([self.labels["model_name"], reason], n)
        yield rejected
        yield self._counter("llmsched:engine_steps", "Engine steps run.", snap.num_steps)
        yield self._gauge(
            "llmsched:kv_cache_free_blocks",
            "KV cache blocks free (cached ones included).",
            snap.num_free_blocks,
        )
        yield self._gauge(
            "llmsched:kv_cache_usable_blocks", "KV cache blocks that can hold tokens.", snap.num_usable_blocks
        )
        yield self._gauge(
            "llmsched:num_requests_in_flight",
            "Requests the server holds (queued, running or awaiting admission); capped by "
            "--max-num-queued-requests.",
            adm.num_requests,
        )
        yield self._gauge(
            "llmsched:num_queued_prompt_tokens",
            "Prompt tokens of requests without a first token yet; capped by --max-num-queued-tokens.",
            adm.num_queued_tokens,
        )


class DataParallelMetrics:
    """One ServerMetrics per data-parallel rank, exposed together (vLLM's ``engine`` label tells them apart).

    Each output counts on the rank that produced it, each snapshot on its
    rank. Series without an ``engine`` label (the server's own queue limits,
    tenants) are the server's, not a rank's, so they appear once.
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        num_ranks: int,
        snapshot: Callable[[int], EngineSnapshot],
        admission: Callable[[], AdmissionControl],
        *,
        cache_config: dict[str, str] | None = None,
        kv_cache_metrics: bool = False,
    ) -> None:
        self.ranks = [
            ServerMetrics(
                model_name,
                max_model_len,
                functools.partial(snapshot, r),
                admission,
                cache_config=cache_config,
                kv_cache_metrics=kv_cache_metrics,
                engine=r,
            )
            for r in range(num_ranks)
        ]
        for m in self.ranks[1:]:
            m.tenants = self.ranks[0].tenants
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def on_output(self, stream: RequestStream, out: OutputDelta, token_time: float) -> None:
        """Count one output on its rank."""
        self.ranks[stream.rank].on_output(stream, out, token_time)

    def on_snapshot(self, snap: EngineSnapshot) -> None:
        """Count a snapshot on its rank."""
        self.ranks[snap.engine].on_snapshot(snap)

    def on_rejected(self, reason: str) -> None:
        """Count a request refused by the server's queue limits."""
        self.ranks[0].on_rejected(reason)

    def render(self) -> bytes:
        """The Prometheus text format of every rank's metrics."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector hook: each family once, with every rank's series."""
        families: dict[str, Metric] = {}
        for m in self.ranks:
            for fam in m.collect():
                have = families.get(fam.name)
                if have is None:
                    families[fam.name] = fam
                else:
                    have.samples.extend(s for s in fam.samples if "engine" in s.labels)
        yield from families.values()
