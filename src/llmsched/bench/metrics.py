"""Serving metrics from per-request timestamps, under vLLM's benchmark key names.

Shared by ``llmsched simulate`` (virtual clock), ``bench throughput`` and
``bench serve`` (wall clock), so the three report the same numbers the same
way. Definitions follow ``vllm bench serve``:

- TTFT: first token time - start (when the request was sent);
- TPOT: (end - first token) / (output tokens - 1), over requests with more
  than one output token;
- ITL: every gap between consecutive tokens of a request;
- E2EL: end - start;
- throughputs: totals over the benchmark duration;
- goodput: completed requests meeting every given SLO (TTFT, TPOT, E2EL in
  ms; a one-token request's TPOT counts as 0), per second.

Percentiles interpolate linearly between order statistics (numpy's default)
and ``std`` is the population standard deviation, as in vLLM. Per-request
figures are kept in compact arrays and ITLs as a histogram of exact values
(a simulator produces few distinct gaps), so millions of requests fit.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmsched.core.errors import ConfigError

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
METRICS = ("ttft", "tpot", "itl", "e2el")
_NAMES = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "itl": "ITL",
    "e2el": "E2EL",
}
_HEADERS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def percentile_sorted(values: Sequence[float], q: float) -> float:
    """q-th percentile (0-100) of sorted values, linearly interpolated; 0 when empty."""
    n = len(values)
    if n == 0:
        return 0.0
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = lo + 1 if lo + 1 < n else lo
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def weighted_percentile(pairs: Sequence[tuple[float, int]], q: float) -> float:
    """Percentile of a multiset given as sorted (value, count) pairs; equals the expanded list's."""
    total = sum(c for _, c in pairs)
    if total == 0:
        return 0.0
    pos = (total - 1) * q / 100.0
    lo = int(pos)
    hi = lo + 1 if lo + 1 < total else lo
    v_lo = v_hi = pairs[-1][0]
    found_lo = False
    cum = 0
    for v, c in pairs:
        cum += c  # expanded indices [cum - c, cum) hold v
        if not found_lo and lo < cum:
            v_lo, found_lo = v, True
        if hi < cum:
            v_hi = v
            break
    return v_lo + (v_hi - v_lo) * (pos - lo)


def _stats(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    s = sorted(values)
    n = len(s)
    mean = math.fsum(s) / n if n else 0.0
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in s) / n) if n else 0.0
    out = {"mean": mean, "median": percentile_sorted(s, 50.0), "std": std}
    for p in percentiles:
        out[_pword(p)] = percentile_sorted(s, p)
    return out


def _weighted_stats(counts: dict[float, int], percentiles: Sequence[float]) -> dict[str, float]:
    pairs = sorted(counts.items())
    n = sum(c for _, c in pairs)
    mean = math.fsum(v * c for v, c in pairs) / n if n else 0.0
    std = math.sqrt(math.fsum(c * (v - mean) ** 2 for v, c in pairs) / n) if n else 0.0
    out = {"mean": mean, "median": weighted_percentile(pairs, 50.0), "std": std}
    for p in percentiles:
        out[_pword(p)] = weighted_percentile(pairs, p)
    return out


def _pword(p: float) -> str:
    return "p" + (str(int(p)) if int(p) == p else str(p))


@dataclass(slots=True)
class RequestTiming:
    """One request as a benchmark client saw it (seconds on any one clock)."""

    start: float
    prompt_len: int
    output_len: int = 0
    first_token: float = math.nan
    end: float = math.nan
    # Gaps between consecutive tokens; len == output_len - 1 when streamed.
    itl: list[float] = field(default_factory=list)
    success: bool = True


class MetricsCollector:
    """Accumulates finished requests; ``summary()`` gives vLLM-named metrics."""

    __slots__ = (
        "_active",
        "_itl",
        "_token_buckets",
        "e2els",
        "failed",
        "failed_input_tokens",
        "input_lens",
        "origin",
        "output_lens",
        "start_times",
        "ttfts",
    )

    def __init__(self, origin: float = 0.0) -> None:
        self.origin = origin
        self.start_times = array("d")
        self.ttfts = array("d")
        self.e2els = array("d")
        self.input_lens = array("q")
        self.output_lens = array("q")
        self.failed = 0
        self.failed_input_tokens = 0
        self._itl: dict[float, int] = {}
        # Output tokens per whole second since origin, and requests active
        # per second as a difference array (O(1) per request).
        self._token_buckets: dict[int, int] = {}
        self._active: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.ttfts)

    def add_request(
        self,
        start: float,
        first_token: float,
        end: float,
        prompt_len: int,
        output_len: int,
        itl: Iterable[float] | None = None,
    ) -> None:
        """A completed request; ``itl`` gaps, when given, are recorded (with their token times)."""
        self.start_times.append(start)
        self.ttfts.append(first_token - start)
        self.e2els.append(end - start)
        self.input_lens.append(prompt_len)
        self.output_lens.append(output_len)
        origin = self.origin
        a = int(start - origin)
        b = int(end - origin) + 1
        active = self._active
        active[a] = active.get(a, 0) + 1
        active[b] = active.get(b, 0) - 1
        if itl is not None:
            t = first_token
            self.add_tokens_at(t, 1)
            counts = self._itl
            for gap in itl:
                counts[gap] = counts.get(gap, 0) + 1
                t += gap
                self.add_tokens_at(t, 1)

    def add_itl(self, gap: float, count: int = 1) -> None:
        """``count`` inter-token gaps of ``gap`` seconds."""
        counts = self._itl
        counts[gap] = counts.get(gap, 0) + count

    def add_tokens_at(self, t: float, count: int) -> None:
        """``count`` output tokens delivered at time ``t`` (for the peak tokens/s figure)."""
        k = int(t - self.origin)
        b = self._token_buckets
        b[k] = b.get(k, 0) + count

    def add_steps(self, ends: Sequence[float], prev_end: float, count: int) -> float:
        """Steps ending at ``ends`` that each gave ``count`` requests a token, all sampled at the step before.

        The first gap is from ``prev_end``; returns the last end.
        """
        if not ends:
            return prev_end
        self.add_step_tokens(ends, count)
        itl = self._itl
        gaps = itl.get
        for end in ends:
            gap = end - prev_end
            itl[gap] = gaps(gap, 0) + count
            prev_end = end
        return prev_end

    def add_step_tokens(self, ends: Sequence[float], count: int) -> None:
        """``count`` tokens at each of ``ends`` (ascending, not empty), for the peak tokens/s figure."""
        origin = self.origin
        k = int(ends[0] - origin)
        if count and k == int(ends[-1] - origin):
            # Ends only grow (and so do their buckets): a run within one
            # second, the usual case, is one addition.
            buckets = self._token_buckets
            buckets[k] = buckets.get(k, 0) + count * len(ends)
        else:
            self._add_step_tokens(ends, count)

    def itl_counts(self) -> dict[float, int]:
        """The inter-token gaps counted so far (gap seconds -> count), for adders that count in bulk."""
        return self._itl

    def _add_step_tokens(self, ends: Iterable[float], count: int) -> None:
        """``count`` tokens at each of ``ends`` (ascending), added once per one-second bucket."""
        origin = self.origin
        buckets = self._token_buckets
        k = -1
        tokens = 0
        for end in ends:
            b = int(end - origin)
            if b != k:
                if tokens:
                    buckets[k] = buckets.get(k, 0) + tokens
                    tokens = 0
                k = b
            tokens += count
        if tokens:
            buckets[k] = buckets.get(k, 0) + tokens

    def add_failed(self, prompt_len: int = 0) -> None:
        """A request that never completed (rejected or errored)."""
        self.failed += 1
        self.failed_input_tokens += prompt_len

    # ---- per-request values (seconds) ---------------------------------------

    def tpots(self) -> list[float]:
        """TPOT of each request with more than one output token."""
        return [(e - t) / (n - 1) for t, e, n in zip(self.ttfts, self.e2els, self.output_lens) if n > 1]

    def itl_histogram(self) -> list[tuple[float, int]]:
        """Sorted (gap seconds, count)."""
        return sorted(self._itl.items())

    def good_count(self, slos_ms: dict[str, float]) -> int:
        """Requests meeting every SLO (keys ttft, tpot, e2el; values in ms)."""
        unknown = set(slos_ms) - set(GOODPUT_KEYS)
        if unknown:
            raise ValueError(f"unknown goodput SLO {sorted(unknown)}; use {', '.join(GOODPUT_KEYS)}")
        lim_ttft = slos_ms.get("ttft", math.inf) / 1000.0
        lim_tpot = slos_ms.get("tpot", math.inf) / 1000.0
        lim_e2el = slos_ms.get("e2el", math.inf) / 1000.0
        good = 0
        for ttft, e2el, n in zip(self.ttfts, self.e2els, self.output_lens):
            tpot = (e2el - ttft) / (n - 1) if n > 1 else 0.0
            if ttft <= lim_ttft and tpot <= lim_tpot and e2el <= lim_e2el:
                good += 1
        return good

    # ---- summary ---------------------------------------------------------------

    def summary(
        self,
        duration: float,
        goodput_slos_ms: dict[str, float] | None = None,
        percentiles: Sequence[float] = DEFAULT_PERCENTILES,
        detailed: bool = False,
    ) -> dict:
        """vLLM ``bench serve`` result keys (plus ``input_throughput``); times in ms."""
        completed = len(self.ttfts)
        total_in = sum(self.input_lens)
        total_out = sum(self.output_lens)
        dur = duration if duration > 0 else math.inf
        res: dict = {
            "duration": duration,
            "completed": completed,
            "failed": self.failed,
            "total_input_tokens": total_in,
            "total_output_tokens": total_out,
            "request_throughput": completed / dur,
            "request_goodput": self.good_count(goodput_slos_ms) / dur if goodput_slos_ms else None,
            "output_throughput": total_out / dur,
            "input_throughput": total_in / dur,
            "total_token_throughput": (total_in + total_out) / dur,
            "max_output_tokens_per_s": float(max(self._token_buckets.values(), default=0)),
            "max_concurrent_requests": self._max_active(),
        }
        per_metric = {
            "ttft": _stats(self.ttfts, percentiles),
            "tpot": _stats(self.tpots(), percentiles),
            "itl": _weighted_stats(self._itl, percentiles),
            "e2el": _stats(self.e2els, percentiles),
        }
        for m in METRICS:
            for k, v in per_metric[m].items():
                res[f"{k}_{m}_ms"] = v * 1000.0
        if detailed:
            res["input_lens"] = list(self.input_lens)
            res["output_lens"] = list(self.output_lens)
            res["ttfts"] = list(self.ttfts)
            res["latencies"] = list(self.e2els)
            res["start_times"] = list(self.start_times)
        return res

    def _max_active(self) -> int:
        running = best = 0
        for k in sorted(self._active):
            running += self._active[k]
            best = max(best, running)
        return best


def summarize(
    requests: Iterable[RequestTiming],
    duration: float,
    goodput_slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict:
    """Metrics for a list of per-request timings (a benchmark client's view)."""
    reqs = list(requests)
    origin = min((r.start for r in reqs), default=0.0)
    c = MetricsCollector(origin=origin)
    for r in reqs:
        if r.success:
            c.add_request(r.start, r.first_token, r.end, r.prompt_len, r.output_len, r.itl)
        else:
            c.add_failed(r.prompt_len)
    return c.summary(duration, goodput_slos_ms, percentiles)


def parse_percentiles(text: str) -> list[float]:
    """The --metric-percentiles list: comma-separated numbers in [0, 100]."""
    try:
        ps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--metric-percentiles {text!r}: expected numbers like 50,90,99") from None
    if not ps or not all(0.0 <= q <= 100.0 for q in ps):
        raise ConfigError(f"--metric-percentiles {text!r}: each must be in [0, 100]")
    return ps


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """SLOs from vLLM's ``--goodput ttft:300 tpot:50`` form (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or ():
        key, sep, val = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r}: expected KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {val!r} is not a number") from None
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
        out[key] = ms
    return out


def format_summary(
    res: dict,
    title: str = "Serving Benchmark Result",
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    extra: Sequence[tuple[str, object]] = (),
    request_rate: float | None = None,
    max_concurrency: int | None = None,
) -> str:
    """The result as vLLM prints it (50-column table), with ``extra`` rows at the end."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label: str, value: object) -> None:
        if isinstance(value, float):
            lines.append(f"{label:<40} {value:<10.2f}")
        else:
            lines.append(f"{label:<40} {value!s:<10}")

    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate is not None and not math.isinf(request_rate):
        row("Request rate configured (RPS):", float(request_rate))
    row("Benchmark duration (s):", float(res["duration"]))
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", float(res["request_throughput"]))
    if res.get("request_goodput") is not None:
        row("Request goodput (req/s):", float(res["request_goodput"]))
    row("Input token throughput (tok/s):", float(res["input_throughput"]))
    row("Output token throughput (tok/s):", float(res["output_throughput"]))
    row("Peak output token throughput (tok/s):", float(res["max_output_tokens_per_s"]))
    row("Peak concurrent requests:", float(res["max_concurrent_requests"]))
    row("Total token throughput (tok/s):", float(res["total_token_throughput"]))
    for m in METRICS:
        lines.append(f"{_HEADERS[m]:-^50}")
        row(f"Mean {_NAMES[m]} (ms):", float(res[f"mean_{m}_ms"]))
        row(f"Median {_NAMES[m]} (ms):", float(res[f"median_{m}_ms"]))
        for p in percentiles:
            if p == 50.0:
                continue  # the median row already shows it
            w = _pword(p)
            row(f"P{w[1:]} {_NAMES[m]} (ms):", float(res[f"{w}_{m}_ms"]))
    if extra:
        lines.append(f"{'Scheduler':-^50}")
        for label, value in extra:
            row(label, value)
    lines.append("=" * 50)
    return "\n".join(lines)
