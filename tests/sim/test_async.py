"""Async scheduling in the simulator: host path and model time overlap, tokens keep their own step's time."""

from __future__ import annotations

import io
import itertools
import json
import math
from array import array
from dataclasses import replace

import pytest

from llmsched.core import Request, SamplingParams, SchedulerConfig
from llmsched.core.errors import ConfigError
from llmsched.core.output import SchedulerOutput
from llmsched.executor.sim.cost_model import BatchShape, ConstantCostModel, CostModel, step_parts_of
from llmsched.executor.sim.executor import SimExecutor
from llmsched.executor.sim.hardware import load_hardware
from llmsched.executor.sim.model_shapes import load_model
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.runner import simulate
from llmsched.sim.workload import Workload, synthetic_workload


class PrefillDecode:
    """Host path ``host`` s a step; model time ``prefill`` s for a step with a prefill, else ``decode``."""

    def __init__(self, host: float, prefill: float, decode: float) -> None:
        self.host, self.prefill, self.decode = host, prefill, decode

    def step_parts(self, batch: BatchShape) -> tuple[float, float, float]:
        model = self.prefill if batch.prefill_tokens else self.decode
        return self.host + model, self.host, model

    def step_time(self, batch: BatchShape) -> float:
        return self.step_parts(batch)[0]


def one_request(arrival: float, prompt: int, out: int) -> Workload:
    return Workload(array("d", [arrival]), array("l", [prompt]), array("l", [out]))


def cfg(async_scheduling: bool, **kw) -> SchedulerConfig:
    return SchedulerConfig(
        **{"num_gpu_blocks": 200, "max_model_len": 256, **kw}, async_scheduling=async_scheduling
    )


def trace_of(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()[1:]]


# ---- the overlap rule on the executor -------------------------------------------


def decode_output(step: int, n: int) -> SchedulerOutput:
    """A step of ``n`` one-token decodes (at position 10), each sampling."""
    reqs = []
    for i in range(n):
        r = Request(f"r{step}-{i}", list(range(10)), SamplingParams(max_tokens=4))
        r.num_computed_tokens = 10
        reqs.append(r)
    return SchedulerOutput(
        step=step, scheduled=reqs, num_scheduled_tokens=[1] * n, total_num_scheduled_tokens=n
    )


class ByTokens:
    """(host, model) seconds by the step's token count."""

    def __init__(self, table: dict[int, tuple[float, float]]) -> None:
        self.table = table

    def step_parts(self, batch: BatchShape) -> tuple[float, float, float]:
        h, m = self.table[batch.num_tokens]
        return h + m, h, m

    def step_time(self, batch: BatchShape) -> float:
        return self.step_parts(batch)[0]


def test_pipeline_by_hand():
    """Host and device as two resources: a step's forward follows its host path and the
    previous forward; the host schedules again once its own work is done."""
    ex = SimExecutor(ByTokens({1: (2.0, 1.0), 2: (1.0, 4.0), 3: (0.5, 0.5)}), async_scheduling=True)
    # Step 0 (host-bound, nothing before it): host 0-2, forward 2-3.
    ex.execute(decode_output(0, 1))
    t0 = ex.timing(0)
    assert (t0.start, t0.end, t0.host_gap, t0.duration, ex.now) == (0.0, 3.0, 2.0, 3.0, 2.0)
    # Step 1 (model-bound), scheduled at 2 while step 0 runs: host 2-3, forward 3-7.
    ex.execute(decode_output(1, 2))
    t1 = ex.timing(1)
    assert (t1.start, t1.end, t1.host_gap, t1.duration, ex.now) == (2.0, 7.0, 0.0, 4.0, 3.0)
    # The engine applies step 0 (waits for its output at 3), then schedules step 2:
    # host 3-3.5, forward 7-7.5 behind step 1's.
    ex.advance_to(t0.end)
    ex.execute(decode_output(2, 3))
    t2 = ex.timing(2)
    assert (t2.start, t2.end, t2.host_gap, t2.duration) == (3.0, 7.5, 0.0, 0.5)
    # Applying step 1 waits until 7; step 3 (host-bound again) starts there: host 7-9,
    # the device idles 7.5-9 after step 2's forward, forward 9-10.
    ex.advance_to(t1.end)
    ex.execute(decode_output(3, 1))
    t3 = ex.timing(3)
    assert (t3.start, t3.end, t3.host_gap, t3.duration) == (7.0, 10.0, 1.5, 2.5)
    # Only the last two executed steps are kept.
    assert ex.timing(1) is None and ex.timing(2) is t2
    # Each step's clock time is its forward plus the device's wait for its host path.
    for t in (t0, t1, t2, t3):
        assert t.duration == t.host_gap + t.model


def test_sync_executor_charges_host_plus_model():
    ex = SimExecutor(ByTokens({1: (2.0, 1.0)}))
    ex.execute(decode_output(0, 1))
    t = ex.timing(0)
    assert (t.start, t.end, t.host, t.model, t.host_gap, t.duration) == (0.0, 3.0, 2.0, 1.0, 2.0, 3.0)
    assert ex.now == 3.0 and ex.last_duration == 3.0


def test_a_cost_model_without_the_split_is_all_model_time():
    class Plain:
        def step_time(self, batch: BatchShape) -> float:
            return 0.25

    assert step_parts_of(Plain())(BatchShape(num_tokens=1)) == (0.25, 0.0, 0.25)
    assert ConstantCostModel(1.0, 3.0).step_parts(BatchShape(num_tokens=1)) == (4.0, 3.0, 1.0)
    assert ConstantCostModel(0.5).step_time(BatchShape()) == 0.5
    with pytest.raises(ConfigError):
        ConstantCostModel(-1.0)


# ---- the runner: hand-computed timelines -----------------------------------------


@pytest.mark.parametrize(
    ("host", "model", "sync_tpot", "async_tpot", "async_gaps"),
    [
        # Host-bound: after the first step the clock moves by the host path, the
        # device waits host - model for each forward.
        (3.0, 1.0, 4.0, 3.0, [3.0, 2.0, 2.0, 2.0, 2.0]),
        # Model-bound: the host path hides behind the previous forward.
        (1.0, 3.0, 4.0, 3.0, [1.0, 0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_lone_request_timeline(host, model, sync_tpot, async_tpot, async_gaps):
    """Arrives at 2 s; prompt 10, 5 tokens. The first step overlaps nothing (host + model)
    in both modes; afterwards a sync step costs host + model, an async one the larger."""
    cost = ConstantCostModel(model, host)
    sync = simulate(cfg(False), one_request(2.0, 10, 5), cost, record_series=True)
    buf = io.StringIO()
    asy = simulate(cfg(True), one_request(2.0, 10, 5), cost, record_series=True, trace_out=buf)
    first = host + model
    for res in (sync, asy):
        assert res.summary["mean_ttft_ms"] == 1000 * first
        assert res.summary["total_output_tokens"] == 5
        assert res.step_costs.num_steps == 5
        assert res.step_costs.host_s == 5 * host and res.step_costs.model_s == 5 * model
    assert sync.summary["mean_tpot_ms"] == sync.summary["p99_itl_ms"] == 1000 * sync_tpot
    assert sync.sim_duration_s == 2.0 + first + 4 * sync_tpot
    assert list(sync.series.host_gap)[:5] == [host] * 5
    assert asy.summary["mean_tpot_ms"] == asy.summary["p99_itl_ms"] == 1000 * async_tpot
    assert asy.sim_duration_s == 2.0 + first + 4 * async_tpot
    assert [g for g, m in zip(asy.series.host_gap, asy.series.model) if m] == async_gaps
    assert asy.step_costs.host_gap_s == sum(async_gaps)
    # The trace's steps tile the busy period: each starts where the previous forward ended.
    busy = [r for r in trace_of(buf) if r["total_tokens"]]
    assert busy[0]["sim_time_s"] == 2.0
    for a, b in itertools.pairwise(busy):
        assert b["sim_time_s"] == a["sim_time_s"] + a["sim_duration_s"]
    assert busy[-1]["sim_time_s"] + busy[-1]["sim_duration_s"] == asy.sim_duration_s


def test_tokens_are_timed_by_their_own_step():
    """A 10 s prefill, then 1 s decodes, 0.5 s of host path each. With async scheduling
    the engine applies the prefill's token one call later, after the first decode was
    scheduled: the token must still be timed at the prefill's end (10.5 s), and the
    request's finish at its last decode's end, not at the later steps'."""
    cost = PrefillDecode(host=0.5, prefill=10.0, decode=1.0)
    res = simulate(cfg(True), one_request(0.0, 10, 3), cost)
    s = res.summary
    # Prefill: host 0-0.5, forward 0.5-10.5. Decode 1: host 0.5-1, forward 10.5-11.5.
    # Decode 2: scheduled once the prefill's output is in (10.5), forward 11.5-12.5.
    assert s["mean_ttft_ms"] == 10500.0
    assert s["mean_e2el_ms"] == 12500.0
    assert s["mean_tpot_ms"] == 1000.0 and s["p99_itl_ms"] == 1000.0
    assert res.sim_duration_s == 12.5
    sync = simulate(cfg(False), one_request(0.0, 10, 3), cost).summary
    assert (sync["mean_ttft_ms"], sync["mean_e2el_ms"]) == (10500.0, 13500.0)


def test_an_arrival_during_a_forward_waits_for_the_next_turn():
    """Request b arrives at 1 s, while a's prefill runs (0.5-10.5 s). The engine has
    already scheduled a's first decode (at 0.5 s) and waits for the prefill's output, so
    it admits b in the next turn, at 10.5 s; b's prefill runs behind that decode's
    forward (10.5-11.5 s): its first token at 21.5 s."""
    cost = PrefillDecode(host=0.5, prefill=10.0, decode=1.0)
    wl = Workload(array("d", [0.0, 1.0]), array("l", [10, 10]), array("l", [2, 2]))
    buf = io.StringIO()
    res = simulate(cfg(True), wl, cost, trace_out=buf)
    recs = trace_of(buf)
    assert recs[0]["added"] == ["0"] and recs[0]["sched"] == [["0", 10]]
    # Turn 1 (at 0.5 s) decodes a; turn 2 waits for a's prefill output (10.5 s) and admits b.
    assert recs[1]["sched"] == [["0", 1]] and recs[1]["added"] == []
    assert recs[2]["added"] == ["1"] and recs[2]["sched"] == [["1", 10]]
    assert recs[2]["sim_time_s"] == 11.5 and recs[2]["sim_model_s"] == 10.0
    assert res.metrics.ttfts == pytest.approx([10.5, 21.5 - 1.0])


def test_closed_loop_frees_a_client_slot_when_its_last_token_exists():
    wl = Workload(array("d", [0.0] * 3), array("l", [10] * 3), array("l", [3] * 3))
    res = simulate(cfg(True), wl, PrefillDecode(host=0.5, prefill=10.0, decode=1.0), max_concurrency=1)
    # Each request alone: 12.5 s from its first schedule() to its last token (as above);
    # the next is sent then, and its host path starts at once.
    assert list(res.metrics.start_times) == [0.0, 12.5, 25.0]
    assert res.summary["mean_e2el_ms"] == 12500.0
    assert res.sim_duration_s == 37.5


# ---- sync stays bit for bit; async gains where the host path matters ------------------


@pytest.mark.parametrize(
    ("spec", "workload", "expected"),
    [
        (
            DeploymentSpec(model="qwen3-0.6b", max_num_seqs=64, hardware="h100-roofline"),
            {
                "n": 500,
                "input_len": 300,
                "output_len": 40,
                "request_rate": 100.0,
                "range_ratio": 0.5,
                "seed": 1,
            },
            {
                "duration": 5.049672449748771,
                "output_throughput": 3992.9322546461685,
                "mean_ttft_ms": 3.5610292100557883,
                "mean_tpot_ms": 1.2548171598257873,
                "p99_itl_ms": 3.0229334398232943,
                "mean_e2el_ms": 52.812029936482524,
            },
        ),
        (
            DeploymentSpec(
                model="qwen3-0.6b", max_num_seqs=32, cuda_graph_max_tokens=0, hardware="h100-roofline"
            ),
            {"n": 200, "input_len": 100, "output_len": 30, "request_rate": math.inf, "seed": 2},
            {
                "duration": 0.5687839817499527,
                "output_throughput": 10548.820277146455,
                "mean_ttft_ms": 226.12932403262334,
                "mean_tpot_ms": 2.557605097074628,
                "p99_itl_ms": 2.5833595223880845,
                "mean_e2el_ms": 300.2998718477876,
            },
        ),
    ],
)
def test_sync_figures_are_unchanged_bit_for_bit(spec, workload, expected):
    """Figures recorded before the host/model split existed (on the roofline h100), compared exactly."""
    dep = build_deployment(spec)
    assert not dep.scheduler_config.async_scheduling
    kw = dict(workload)
    res = simulate(dep, synthetic_workload(kw.pop("n"), kw.pop("input_len"), kw.pop("output_len"), **kw))
    for key, value in expected.items():
        assert res.summary[key] == value, key


def test_step_parts_sum_to_the_sync_price_of_every_step():
    dep = build_deployment(DeploymentSpec(model="qwen3-0.6b", max_num_seqs=32, hardware="h100-roofline"))
    wl = synthetic_workload(100, 600, 20, request_rate=200.0, range_ratio=0.5, seed=3)
    res = simulate(dep, wl, record_series=True)
    s = res.series
    assert sum(s.duration) == pytest.approx(sum(h + m for h, m in zip(s.host, s.model)))
    for dur, host, model, gap in zip(s.duration, s.host, s.model, s.host_gap):
        assert dur == pytest.approx(host + model) and gap == host
    assert res.step_costs.host_s == pytest.approx(sum(s.host))
    assert res.step_costs.model_s == pytest.approx(sum(s.model))
    # Sync: the device waits out every host path.
    assert res.step_costs.host_gap_s == res.step_costs.host_s > 0.3 * res.step_costs.model_s


@pytest.fixture(scope="module")
def small_model_runs():
    """qwen3-0.6b on an H100, decode-heavy: its host path (0.5 ms a step) rivals its forwards."""
    # The plain roofline, whose forwards are short enough for the host path to rival them.
    spec = DeploymentSpec(model="qwen3-0.6b", max_num_seqs=64, hardware="h100-roofline")
    wl = synthetic_workload(300, 256, 64, request_rate=math.inf, seed=4)
    return {
        a: simulate(build_deployment(replace(spec, async_scheduling=a)), wl, record_series=True)
        for a in (False, True)
    }


def test_async_throughput_is_at_least_sync_on_a_host_bound_workload(small_model_runs):
    sync, asy = small_model_runs[False].summary, small_model_runs[True].summary
    assert asy["completed"] == sync["completed"] == 300
    assert asy["total_output_tokens"] == sync["total_output_tokens"]
    assert asy["output_throughput"] >= 1.2 * sync["output_throughput"]
    assert asy["mean_tpot_ms"] < sync["mean_tpot_ms"]
    costs = small_model_runs[True].step_costs
    assert costs.async_scheduling and costs.host_gap_s < 0.5 * small_model_runs[False].step_costs.host_gap_s


def test_async_components_add_up(small_model_runs):
    res = small_model_runs[True]
    s, costs = res.series, res.step_costs
    assert costs.host_s == pytest.approx(sum(s.host))
    assert costs.model_s == pytest.approx(sum(s.model))
    assert costs.host_gap_s == pytest.approx(sum(s.host_gap))
    for dur, host, model, gap in zip(s.duration, s.host, s.model, s.host_gap):
        # A step adds its forward and the device's wait for its host path, which
        # async hides in part: max(host, model) <= duration <= host + model in
        # steady state, host + model at the start of a busy period.
        assert dur == pytest.approx(gap + model, abs=1e-12)
        assert 0.0 <= gap <= host + 1e-15
    # The steps tile the run: forwards and waits, no more than the clock.
    assert sum(s.duration) <= res.sim_duration_s + 1e-9
    data = res.to_json()["simulation"]
    assert data["async_scheduling"] is True
    d = data["step_costs"]
    assert d["num_steps"] == res.num_busy_steps
    assert d["mean_host_ms"] == pytest.approx(1e3 * costs.host_s / costs.num_steps)
    assert 0.0 <= d["median_host_gap_ms"] <= d["p99_host_gap_ms"] <= 1e3 * max(s.host)
    assert 0.0 < d["model_busy_fraction"] <= 1.0
    assert "Host gap median / p99 (ms):" in res.table()


# ---- deployment plumbing -------------------------------------------------------------


def test_deployment_carries_the_mode():
    dep = build_deployment(DeploymentSpec(async_scheduling=True))
    assert dep.scheduler_config.async_scheduling is True
    assert "async scheduling on" in " ".join(dep.describe())
    assert dep.to_dict()["scheduler"]["async_scheduling"] is True
    assert build_deployment(DeploymentSpec()).scheduler_config.async_scheduling is False
    with pytest.raises(ConfigError, match="data-parallel"):
        build_deployment(DeploymentSpec(model="qwen3-30b-a3b", data_parallel_size=2, async_scheduling=True))


def test_cost_model_host_path_and_model_time():
    """Host path: step and request overheads, eager or piecewise launches. Model time: the
    kernels, collectives and the per-layer dispatch of a synchronous (cpu) device."""
    hw = replace(load_hardware("h100"), request_overhead_s=1e-5, layer_overhead_s=2e-6)
    cm = CostModel(load_model("llama-3-8b"), hw, cuda_graph_max_tokens=16)
    batches = [
        BatchShape.from_chunks([(100, 1)] * 8, 8),  # graph
        BatchShape.from_chunks([(0, 8), (100, 1)], 2),  # piecewise
        BatchShape.from_chunks([(0, 512), (100, 1)], 2),  # eager
    ]
    for b in batches:
        total, host, model = cm.step_parts(b)
        assert total == cm.step_time(b)  # exactly
        ops = {op.name: op.seconds for op in cm.ops(b)}
        launches = ops.get("eager_launches", 0.0) + ops.get("piecewise_launches", 0.0)
        n = b.num_decodes + b.num_prefills
        assert host == pytest.approx(5e-4 + n * 1e-5 + launches)
        assert model == pytest.approx(total - host)
        assert ops["layer_overhead"] == pytest.approx(32 * 2e-6)
    assert cm.step_parts(BatchShape()) == (0.0, 0.0, 0.0)


class Serial(ByTokens):
    """ByTokens on a machine whose model threads take every core."""

    host_overlaps_model = False


def test_without_a_free_core_the_host_path_waits_for_the_forward():
    """A CPU whose model threads take every core: the next step's host path starts when
    the forward before it ends, so a step costs host + model on the clock."""
    ex = SimExecutor(Serial({1: (2.0, 1.0), 2: (1.0, 4.0)}), async_scheduling=True)
    ex.execute(decode_output(0, 1))
    t0 = ex.timing(0)
    assert (t0.start, t0.end, t0.duration, ex.now) == (0.0, 3.0, 3.0, 2.0)
    # Scheduled at 2 while step 0's forward runs to 3: host 3-4, forward 4-8.
    ex.execute(decode_output(1, 2))
    t1 = ex.timing(1)
    assert (t1.start, t1.end, t1.host_gap, t1.duration, ex.now) == (3.0, 8.0, 1.0, 5.0, 4.0)
    # With a core free (the default), the same step's host path hides behind step 0's forward.
    ex = SimExecutor(ByTokens({1: (2.0, 1.0), 2: (1.0, 4.0)}), async_scheduling=True)
    ex.execute(decode_output(0, 1))
    ex.execute(decode_output(1, 2))
    assert ex.timing(1).end == 7.0
