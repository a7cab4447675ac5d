"""Workloads: arrival processes, length distributions, prefix groups, priorities, traces."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from llmsched.core.errors import ConfigError
from llmsched.sim.workload import arrival_times, load_trace_workload, synthetic_workload


def gaps(times) -> list[float]:
    return [b - a for a, b in zip([0.0, *times[:-1]], times)]


def test_all_at_once():
    wl = synthetic_workload(50, request_rate=math.inf)
    assert set(wl.arrivals) == {0.0}
    assert len(wl) == 50


def test_fixed_rate():
    t = arrival_times(10, 4.0, burstiness=math.inf)
    assert list(t) == pytest.approx([0.25 * (i + 1) for i in range(10)])


def test_poisson_is_scaled_to_n_over_rate_like_vllm():
    t = arrival_times(5000, 20.0, rng=random.Random(1))
    assert t[-1] == pytest.approx(5000 / 20.0)
    g = gaps(t)
    assert all(x >= 0 for x in g)
    assert statistics.mean(g) == pytest.approx(0.05, rel=1e-9)
    # Exponential gaps: coefficient of variation ~1.
    assert 0.9 < statistics.pstdev(g) / statistics.mean(g) < 1.1


def test_burstiness_changes_the_spread_not_the_rate():
    cv = {}
    for b in (0.25, 1.0, 4.0):
        g = gaps(arrival_times(5000, 10.0, burstiness=b, rng=random.Random(2)))
        assert statistics.mean(g) == pytest.approx(0.1)
        cv[b] = statistics.pstdev(g) / statistics.mean(g)
    # Gamma with shape k has CV 1/sqrt(k): 2, 1, 0.5.
    assert cv[0.25] == pytest.approx(2.0, rel=0.15)
    assert cv[1.0] == pytest.approx(1.0, rel=0.1)
    assert cv[4.0] == pytest.approx(0.5, rel=0.1)


def test_bad_rates():
    for rate, burst in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ConfigError):
            arrival_times(3, rate, burst)


def test_lengths_fixed_and_uniform():
    wl = synthetic_workload(100, 512, 64)
    assert set(wl.input_lens) == {512} and set(wl.output_lens) == {64}
    wl = synthetic_workload(2000, 1000, 100, range_ratio=0.5, seed=3)
    assert min(wl.input_lens) >= 500 and max(wl.input_lens) <= 1500
    assert min(wl.output_lens) >= 50 and max(wl.output_lens) <= 150
    assert statistics.mean(wl.input_lens) == pytest.approx(1000, rel=0.03)
    assert len(set(wl.input_lens)) > 100
    with pytest.raises(ConfigError):
        synthetic_workload(10, range_ratio=1.0)


def test_seed_makes_it_reproducible():
    a = synthetic_workload(300, request_rate=5.0, range_ratio=0.3, seed=7)
    b = synthetic_workload(300, request_rate=5.0, range_ratio=0.3, seed=7)
    c = synthetic_workload(300, request_rate=5.0, range_ratio=0.3, seed=8)
    assert list(a.arrivals) == list(b.arrivals) and list(a.input_lens) == list(b.input_lens)
    assert list(a.arrivals) != list(c.arrivals)


def test_prompts_are_unique_from_the_first_block():
    wl = synthetic_workload(3, 64, 8)
    p = [wl.prompt(i) for i in range(3)]
    assert all(len(x) == 64 for x in p)
    assert len({tuple(x[:16]) for x in p}) == 3


def test_prefix_groups_share_exactly_the_prefix():
    wl = synthetic_workload(40, 100, 8, prefix_len=48, num_prefix_groups=3, seed=1)
    assert set(wl.input_lens) == {148}
    groups = list(wl.groups)
    assert set(groups) == {0, 1, 2}
    by_group: dict[int, list[list[int]]] = {}
    for i in range(len(wl)):
        by_group.setdefault(groups[i], []).append(wl.prompt(i))
    for prompts in by_group.values():
        assert len({tuple(p[:48]) for p in prompts}) == 1
        assert len({tuple(p[:49]) for p in prompts}) == len(prompts)
    heads = {tuple(ps[0][:16]) for ps in by_group.values()}
    assert len(heads) == 3


def test_priorities():
    wl = synthetic_workload(500, num_priority_levels=4, seed=2)
    assert set(wl.priorities) == {0, 1, 2, 3}
    assert synthetic_workload(5).priorities is None


def write(tmp_path, lines) -> str:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(p)


def test_trace_file(tmp_path):
    path = write(
        tmp_path,
        [
            {"id": "late", "arrival_time": 2.5, "prompt_len": 10, "output_len": 3, "priority": 1},
            {"id": "early", "timestamp": 0.5, "input_len": 20, "max_tokens": 4},
            {"id": "toks", "arrival_time": 1.0, "prompt_token_ids": [5, 6, 7], "output_len": 2},
        ],
    )
    wl = load_trace_workload(path)
    assert [wl.request_id(i) for i in range(3)] == ["early", "toks", "late"]
    assert list(wl.arrivals) == [0.5, 1.0, 2.5]
    assert list(wl.input_lens) == [20, 3, 10]
    assert list(wl.output_lens) == [4, 2, 3]
    assert list(wl.priorities) == [0, 0, 1]
    assert wl.prompt(1) == [5, 6, 7]
    assert len(wl.prompt(0)) == 20
    # num_prompts keeps the first lines of the file, then sorts them.
    assert load_trace_workload(path, num_prompts=2).request_id(1) == "late"


def test_trace_without_times_uses_the_rate(tmp_path):
    path = write(tmp_path, [{"prompt_len": 8, "output_len": 2}] * 10)
    wl = load_trace_workload(path, request_rate=2.0, burstiness=math.inf)
    assert list(wl.arrivals) == pytest.approx([0.5 * (i + 1) for i in range(10)])


def test_trace_prefix_groups(tmp_path):
    lines = [{"prompt_len": 40, "output_len": 2, "prefix_group": g, "shared_prefix_len": 32} for g in "aab"]
    wl = load_trace_workload(write(tmp_path, lines))
    p = [wl.prompt(i) for i in range(3)]
    assert p[0][:32] == p[1][:32] != p[2][:32]
    assert p[0][:33] != p[1][:33]


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        ([{"output_len": 3}], "needs prompt_len"),
        ([{"prompt_len": 3}], "needs output_len"),
        ([{"prompt_len": 0, "output_len": 1}], ">= 1"),
        ([{"prompt_len": 2.5, "output_len": 1}], "integer"),
        ([{"prompt_len": 3, "output_len": 1, "arrival_time": -1}], "arrival_time"),
        (
            [{"prompt_len": 3, "output_len": 1, "arrival_time": 1}, {"prompt_len": 3, "output_len": 1}],
            "every line",
        ),
        ([{"id": "x", "prompt_len": 3, "output_len": 1}] * 2, "repeats"),
        ([{"prompt_token_ids": [], "output_len": 1}], "non-empty"),
    ],
)
def test_trace_errors(tmp_path, lines, match):
    with pytest.raises(ConfigError, match=match):
        load_trace_workload(write(tmp_path, lines))


def test_trace_not_json(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"prompt_len": 3, "output_len": 1}\nnope\n')
    with pytest.raises(ConfigError, match=":2: not valid JSON"):
        load_trace_workload(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_trace_workload(tmp_path / "missing.jsonl")
