"""Serving metrics on hand-made timelines: TTFT, TPOT, ITL, E2EL, throughput, goodput."""

from __future__ import annotations

import math
import random

import pytest

from llmsched.bench.metrics import (
    MetricsCollector,
    RequestTiming,
    format_summary,
    parse_goodput,
    percentile_sorted,
    summarize,
    weighted_percentile,
)

# Three requests (seconds). Token times:
#   a: sent 0.0, tokens at 0.5, 0.6, 0.8          -> TTFT 0.5, ITL 0.1 0.2, E2EL 0.8, TPOT 0.15
#   b: sent 1.0, tokens at 1.2, 1.5, 1.6, 2.0     -> TTFT 0.2, ITL 0.3 0.1 0.4, E2EL 1.0, TPOT 0.8/3
#   c: sent 2.0, token at 3.0 (one token)         -> TTFT 1.0, no ITL, E2EL 1.0, no TPOT
TIMELINE = [
    RequestTiming(start=0.0, prompt_len=10, output_len=3, first_token=0.5, end=0.8, itl=[0.1, 0.2]),
    RequestTiming(start=1.0, prompt_len=20, output_len=4, first_token=1.2, end=2.0, itl=[0.3, 0.1, 0.4]),
    RequestTiming(start=2.0, prompt_len=30, output_len=1, first_token=3.0, end=3.0, itl=[]),
]


def approx(x: float) -> pytest.approx:
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def np_percentile(values: list[float], q: float) -> float:
    """numpy.percentile's default (linear) method, written out."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def test_hand_made_timeline():
    res = summarize(TIMELINE, duration=4.0)
    assert res["completed"] == 3
    assert res["failed"] == 0
    assert res["total_input_tokens"] == 60
    assert res["total_output_tokens"] == 8
    assert res["request_throughput"] == approx(3 / 4.0)
    assert res["output_throughput"] == approx(8 / 4.0)
    assert res["input_throughput"] == approx(60 / 4.0)
    assert res["total_token_throughput"] == approx(68 / 4.0)
    # TTFT: 0.5, 0.2, 1.0
    assert res["mean_ttft_ms"] == approx(1000 * (0.5 + 0.2 + 1.0) / 3)
    assert res["median_ttft_ms"] == approx(500.0)
    assert res["p99_ttft_ms"] == approx(1000 * np_percentile([0.5, 0.2, 1.0], 99))
    assert res["p90_ttft_ms"] == approx(1000 * (0.5 + (1.0 - 0.5) * 0.8))
    # TPOT only for requests with more than one token: 0.15 and 0.8/3.
    tpots = [0.3 / 2, 0.8 / 3]
    assert res["mean_tpot_ms"] == approx(1000 * sum(tpots) / 2)
    assert res["median_tpot_ms"] == approx(1000 * sum(tpots) / 2)
    # ITL: every gap of every request.
    itls = [0.1, 0.2, 0.3, 0.1, 0.4]
    assert res["mean_itl_ms"] == approx(1000 * sum(itls) / 5)
    assert res["median_itl_ms"] == approx(200.0)
    assert res["p99_itl_ms"] == approx(1000 * np_percentile(itls, 99))
    mean = sum(itls) / 5
    assert res["std_itl_ms"] == approx(1000 * math.sqrt(sum((x - mean) ** 2 for x in itls) / 5))
    # E2EL: 0.8, 1.0, 1.0
    assert res["mean_e2el_ms"] == approx(1000 * 2.8 / 3)
    assert res["median_e2el_ms"] == approx(1000.0)
    assert res["request_goodput"] is None
    # Tokens by whole second: [0,1): 3 (a), [1,2): 3 (b), [2,3): 1 (b at 2.0), [3,4): 1 (c).
    assert res["max_output_tokens_per_s"] == 3.0
    # a spans second 0, b seconds 1-2, c seconds 2-3: two at once in second 2.
    assert res["max_concurrent_requests"] == 2


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT <= 600 ms keeps a and b; TPOT <= 200 ms then keeps only a (b's is 267 ms).
    res = summarize(TIMELINE, duration=4.0, goodput_slos_ms={"ttft": 600, "tpot": 200})
    assert res["request_goodput"] == approx(1 / 4.0)
    # A one-token request's TPOT counts as 0, so c passes a TPOT-only SLO.
    res = summarize(TIMELINE, duration=4.0, goodput_slos_ms={"tpot": 200})
    assert res["request_goodput"] == approx(2 / 4.0)
    res = summarize(TIMELINE, duration=4.0, goodput_slos_ms={"e2el": 900})
    assert res["request_goodput"] == approx(1 / 4.0)
    with pytest.raises(ValueError, match="unknown goodput SLO"):
        summarize(TIMELINE, duration=4.0, goodput_slos_ms={"latency": 1})


def test_failed_requests_count_but_do_not_enter_latencies():
    reqs = [*TIMELINE, RequestTiming(start=0.0, prompt_len=99, success=False)]
    res = summarize(reqs, duration=4.0)
    assert res["failed"] == 1
    assert res["completed"] == 3
    assert res["total_input_tokens"] == 60


def test_collector_histogram_itls_equal_explicit_gaps():
    """The simulator adds ITLs as (gap, count); the result equals listing every gap."""
    c = MetricsCollector()
    c.add_request(0.0, 0.5, 0.8, 10, 3)
    c.add_request(1.0, 1.2, 2.0, 20, 4)
    c.add_request(2.0, 3.0, 3.0, 30, 1)
    c.add_itl(0.1, 2)
    c.add_itl(0.2)
    c.add_itl(0.3)
    c.add_itl(0.4)
    for t, k in ((0.5, 1), (0.6, 1), (0.8, 1), (1.2, 1), (1.5, 1), (1.6, 1), (2.0, 1), (3.0, 1)):
        c.add_tokens_at(t, k)
    a = c.summary(4.0)
    b = summarize(TIMELINE, 4.0)
    for key, value in b.items():
        assert a[key] == approx(value) if isinstance(value, float) else a[key] == value, key


def test_weighted_percentile_equals_expanded_list():
    rng = random.Random(3)
    for _ in range(200):
        values = [rng.choice([0.01, 0.02, 0.05, 0.2, 1.5]) for _ in range(rng.randint(1, 40))]
        counts: dict[float, int] = {}
        for v in values:
            counts[v] = counts.get(v, 0) + 1
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert weighted_percentile(sorted(counts.items()), q) == approx(np_percentile(values, q))
            assert percentile_sorted(sorted(values), q) == approx(np_percentile(values, q))


def test_empty_collector_reports_zeros():
    res = MetricsCollector().summary(0.0)
    assert res["completed"] == 0
    assert res["request_throughput"] == 0.0
    assert res["mean_ttft_ms"] == 0.0
    assert res["p99_itl_ms"] == 0.0


def test_vllm_key_names():
    res = summarize(TIMELINE, 4.0, percentiles=(99, 99.9))
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99", "p99.9"):
            assert f"{stat}_{m}_ms" in res
    assert "p50_ttft_ms" not in res


def test_parse_goodput():
    assert parse_goodput(["ttft:300", "TPOT:50"]) == {"ttft": 300.0, "tpot": 50.0}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["speed:3"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_format_summary_lists_the_metrics():
    text = format_summary(
        summarize(TIMELINE, 4.0, {"ttft": 600}), extra=[("Preemptions:", 3)], request_rate=2.0
    )
    assert "Request throughput (req/s):" in text
    assert "Request goodput (req/s):" in text
    assert "Request rate configured (RPS):" in text
    assert "Mean TTFT (ms):" in text and "P99 ITL (ms):" in text and "P90 E2EL (ms):" in text
    assert "Preemptions:" in text
    assert "P50 " not in text  # shown as the median


@pytest.mark.parametrize("span", [0.3, 2.7])
def test_add_steps_counts_as_step_by_step_adds(span):
    """A run of steps (within one second, or across several) counts as adding each step's gap and tokens."""
    from array import array

    ends = array("d", [5.05 + span * j / 40 for j in range(1, 41)])
    run, steps = MetricsCollector(), MetricsCollector()
    assert run.add_steps(ends, 5.05, 3) == ends[-1]
    assert run.add_steps(array("d"), 7.0, 3) == 7.0
    prev = 5.05
    for end in ends:
        steps.add_itl(end - prev, 3)
        steps.add_tokens_at(end, 3)
        prev = end
    assert run.itl_histogram() == steps.itl_histogram()
    assert run._token_buckets == steps._token_buckets
    assert len(run._token_buckets) == (1 if span < 0.9 else 3)
