"""What a simulation produced: the serving metrics, the scheduler's figures, per-step series."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import reduce
from operator import add

from llmsched.bench.metrics import DEFAULT_PERCENTILES, MetricsCollector, format_summary, percentile_sorted
from llmsched.executor.sim.executor import StepTiming
from llmsched.sim.deployment import Deployment
from llmsched.sim.workload import Workload


@dataclass(slots=True)
class StepSeries:
    """Per-step state over simulated time (for plots)."""

    time: array = field(default_factory=lambda: array("d"))
    duration: array = field(default_factory=lambda: array("d"))
    num_running: array = field(default_factory=lambda: array("l"))
    num_waiting: array = field(default_factory=lambda: array("l"))
    kv_usage: array = field(default_factory=lambda: array("d"))
    prefill_tokens: array = field(default_factory=lambda: array("l"))
    decode_tokens: array = field(default_factory=lambda: array("l"))
    # The step's host path, model time and the device's wait for the host
    # (see StepTiming), seconds; 0 for a step that ran no tokens.
    host: array = field(default_factory=lambda: array("d"))
    model: array = field(default_factory=lambda: array("d"))
    host_gap: array = field(default_factory=lambda: array("d"))

    def __len__(self) -> int:
        return len(self.time)


@dataclass(slots=True)
class StepCosts:
    """Host path and model time summed over the steps that ran tokens, and the device's waits."""

    async_scheduling: bool = False
    num_steps: int = 0
    host_s: float = 0.0
    model_s: float = 0.0
    host_gap_s: float = 0.0
    # Per step, for percentiles.
    host_gaps: array = field(default_factory=lambda: array("d"))

    def add_serial(self, hosts: Sequence[float], models: Sequence[float]) -> None:
        """Count executed sync steps by their parts (a sync step's host gap is its host path)."""
        if len(hosts) != len(models):
            raise ValueError(f"{len(hosts)} host paths for {len(models)} model times")
        # Each total still adds one step at a time, in order (the same sums as a loop), at C speed.
        self.host_s = reduce(add, hosts, self.host_s)
        self.model_s = reduce(add, models, self.model_s)
        self.host_gap_s = reduce(add, hosts, self.host_gap_s)
        self.num_steps += len(hosts)
        self.host_gaps.extend(hosts)

    def add(self, t: StepTiming) -> None:
        """Count one executed step with tokens."""
        self.num_steps += 1
        self.host_s += t.host
        self.model_s += t.model
        self.host_gap_s += t.host_gap
        self.host_gaps.append(t.host_gap)

    def to_dict(self, duration: float) -> dict:
        """Totals (s), per-step means and host-gap percentiles (ms), the device's busy share."""
        n = self.num_steps or 1
        gaps = sorted(self.host_gaps)
        return {
            "async_scheduling": self.async_scheduling,
            "num_steps": self.num_steps,
            "host_s": self.host_s,
            "model_s": self.model_s,
            "host_gap_s": self.host_gap_s,
            "mean_host_ms": 1e3 * self.host_s / n,
            "mean_model_ms": 1e3 * self.model_s / n,
            "mean_host_gap_ms": 1e3 * self.host_gap_s / n,
            "median_host_gap_ms": 1e3 * percentile_sorted(gaps, 50.0),
            "p99_host_gap_ms": 1e3 * percentile_sorted(gaps, 99.0),
            "model_busy_fraction": self.model_s / duration if duration > 0 else 0.0,
        }

    def rows(self) -> list[tuple[str, object]]:
        """Summary-table rows."""
        d = self.to_dict(0.0)
        return [
            ("Async scheduling:", "on" if self.async_scheduling else "off"),
            ("Mean host path / model per step (ms):", f"{d['mean_host_ms']:.3f} / {d['mean_model_ms']:.3f}"),
            ("Host gap median / p99 (ms):", f"{d['median_host_gap_ms']:.3f} / {d['p99_host_gap_ms']:.3f}"),
        ]


# What a request that did not finish before the run stopped (max_steps) shows in ``errors``.
UNFINISHED = "not finished when the simulation stopped"


class RequestLog:
    """vLLM's per-request lists (``--save-detailed``): one entry per workload request, in dataset order.

    Requests finish in whatever order the scheduler runs them; each is
    written at its own position (its dataset line), so the lists zip with
    the dataset as a ``vllm bench serve`` result's do. A request that failed
    reads as vLLM writes one: output length, TTFT and latency 0, its reason
    in ``errors`` ("" for a success).
    """

    __slots__ = ("errors", "input_lens", "latencies", "output_lens", "position", "start_times", "ttfts")

    def __init__(self, workload: Workload) -> None:
        n = len(workload)
        order = workload.file_index
        self.position = list(order) if order is not None else range(n)
        self.input_lens = [0] * n
        self.start_times = [0.0] * n
        for i, at in enumerate(self.position):
            self.input_lens[at] = workload.input_lens[i]
            self.start_times[at] = workload.arrivals[i]
        self.output_lens = [0] * n
        self.ttfts = [0.0] * n
        self.latencies = [0.0] * n
        self.errors = [UNFINISHED] * n

    def done(
        self, i: int, sent: float, first_token: float, end: float, prompt_len: int, output_len: int
    ) -> None:
        """Workload request ``i`` completed."""
        at = self.position[i]
        self.input_lens[at] = prompt_len
        self.output_lens[at] = output_len
        self.start_times[at] = sent
        self.ttfts[at] = first_token - sent
        self.latencies[at] = end - sent
        self.errors[at] = ""

    def failed(self, i: int, sent: float, prompt_len: int, error: str) -> None:
        """Workload request ``i`` failed (refused or declined) with ``error``."""
        at = self.position[i]
        self.input_lens[at] = prompt_len
        self.start_times[at] = sent
        self.errors[at] = error

    def lists(self) -> dict:
        """The lists, under vLLM's keys (times in seconds)."""
        return {
            "input_lens": list(self.input_lens),
            "output_lens": list(self.output_lens),
            "ttfts": list(self.ttfts),
            "latencies": list(self.latencies),
            "start_times": list(self.start_times),
            "errors": list(self.errors),
        }


@dataclass(slots=True)
class SimResult:
    """What a simulation produced."""

    metrics: MetricsCollector
    summary: dict
    num_requests: int
    num_steps: int
    num_busy_steps: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    max_running: int
    num_length_capped: int
    sim_duration_s: float
    wall_s: float
    rejections: list[tuple[str, str]]
    series: StepSeries | None = None
    deployment: Deployment | None = None
    workload_description: str = ""
    max_concurrency: int | None = None
    request_rate: float = math.inf
    percentiles: Sequence[float] = DEFAULT_PERCENTILES
    # Data-parallel runs: mode, policies and per-rank figures (see dp_group).
    data_parallel: dict | None = None
    # Single-engine runs: host path and model time of the steps.
    step_costs: StepCosts | None = None
    # The API servers modelled in front of the engine (None: requests reach it when sent).
    frontend: dict | None = None
    # Requests the scheduling policy declined (they count as failed).
    num_declined: int = 0
    # With record_requests: (tenant, sent, first token, end, prompt, output) per
    # finished request (first token -1 when declined).
    requests: list[tuple] | None = None
    # Speculative decoding's draft and acceptance counts (see one_engine.spec_dict); None: off.
    spec_decode: dict | None = None

    @property
    def wall_us_per_request(self) -> float:
        """Wall time the simulation took per request."""
        return self.wall_s * 1e6 / max(self.num_requests, 1)

    def scheduler_rows(self) -> list[tuple[str, object]]:
        """Scheduler figures for the summary table."""
        rows: list[tuple[str, object]] = [
            ("Engine steps (with tokens):", f"{self.num_steps} ({self.num_busy_steps})"),
            ("Preemptions:", self.num_preemptions),
            ("Prefix cache hit rate (%):", 100.0 * self.prefix_cache_hit_rate),
            ("Max running requests:", self.max_running),
        ]
        if self.num_length_capped:
            rows.append(("Outputs cut at max_model_len:", self.num_length_capped))
        if self.num_declined:
            rows.append(("Declined by the policy:", self.num_declined))
        if self.data_parallel is not None:
            rows.extend(self.data_parallel.get("rows", []))
        if self.step_costs is not None:
            rows.extend(self.step_costs.rows())
        sd = self.spec_decode
        if sd is not None:
            rows.append(("Draft acceptance rate (%):", 100.0 * sd["acceptance_rate"]))
            rows.append(("Mean acceptance length:", f"{sd['mean_acceptance_length']:.3f}"))
        rows.append(
            ("Simulated in (s wall):", f"{self.wall_s:.2f} ({self.wall_us_per_request:.1f} us/request)")
        )
        return rows

    def table(self) -> str:
        """vLLM-style result table plus the scheduler's figures."""
        return format_summary(
            self.summary,
            title="Simulation Result",
            percentiles=self.percentiles,
            extra=self.scheduler_rows(),
            request_rate=self.request_rate,
            max_concurrency=self.max_concurrency,
        )

    def to_json(self) -> dict:
        """vLLM result keys, then the simulation's own figures and the deployment."""
        out = dict(self.summary)
        out["request_rate"] = self.request_rate if not math.isinf(self.request_rate) else "inf"
        out["max_concurrency"] = self.max_concurrency
        out["num_prompts"] = self.num_requests
        out["simulation"] = {
            "num_steps": self.num_steps,
            "num_busy_steps": self.num_busy_steps,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "max_running": self.max_running,
            "num_length_capped": self.num_length_capped,
            "sim_duration_s": self.sim_duration_s,
            "wall_s": self.wall_s,
            "wall_us_per_request": self.wall_us_per_request,
            "workload": self.workload_description,
            "rejections": [list(r) for r in self.rejections],
        }
        if self.data_parallel is not None:
            out["simulation"]["data_parallel"] = {k: v for k, v in self.data_parallel.items() if k != "rows"}
        if self.step_costs is not None:
            out["simulation"]["async_scheduling"] = self.step_costs.async_scheduling
            out["simulation"]["step_costs"] = self.step_costs.to_dict(self.sim_duration_s)
        if self.frontend is not None:
            out["simulation"]["frontend"] = self.frontend
        if self.spec_decode is not None:
            out["simulation"]["spec_decode"] = self.spec_decode
        if self.deployment is not None:
            out["deployment"] = self.deployment.to_dict()
        return out
