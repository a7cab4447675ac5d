"""The simulation loop: same decisions as replay, correct timestamps, bounded queues."""

from __future__ import annotations

import io
import json
import math
from array import array
from pathlib import Path

import pytest

from llmsched.bench.parity import compare, decisions
from llmsched.bench.replay import replay
from llmsched.bench.workload import load_workload, parse_workload
from llmsched.core import SchedulerConfig
from llmsched.core.decode_cohort import DecodeCohort
from llmsched.core.plain_decodes import PlainDecodes
from llmsched.executor.sim.cost_model import ConstantCostModel, CostModel
from llmsched.executor.sim.hardware import load_hardware
from llmsched.executor.sim.model_shapes import load_model
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.frontend import Frontend
from llmsched.sim.runner import simulate
from llmsched.sim.workload import Workload, synthetic_workload

PARITY = Path(__file__).resolve().parents[1] / "data" / "parity"
PARITY_ASYNC = PARITY.parent / "parity_async"
BOOKKEEPING = ("total_tokens", "num_running", "kv_usage", "finished", "preempted", "sched")


def records(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()[1:]]


def replay_records(wl_dict_or_path, **overrides) -> list[dict]:
    wl = (
        load_workload(wl_dict_or_path)
        if isinstance(wl_dict_or_path, Path)
        else parse_workload(wl_dict_or_path)
    )
    buf = io.StringIO()
    replay(wl, buf, **overrides)
    return records(buf)


def assert_same_steps(sim: list[dict], ref: list[dict]) -> None:
    assert compare(sim, ref) == []
    assert len(decisions(sim)) == len(decisions(ref)) > 0
    assert len(sim) == len(ref)
    for a, b in zip(sim, ref):
        for key in BOOKKEEPING:
            assert a[key] == b[key], (a["step"], key)
        assert sorted(map(tuple, a["admitted"])) == sorted(map(tuple, b["admitted"])), a["step"]
        assert a["num_waiting"] - a.get("held_back", 0) == b["num_waiting"], a["step"]


def workload_from_replay(path: Path) -> tuple[Workload, SchedulerConfig]:
    """The replay workload with arrival_step k arriving at k seconds."""
    rw = load_workload(path)
    reqs = sorted(rw.requests, key=lambda r: r.arrival_step)
    wl = Workload(
        array("d", [float(r.arrival_step) for r in reqs]),
        array("l", [len(r.prompt_token_ids) for r in reqs]),
        array("l", [r.max_tokens for r in reqs]),
        priorities=array("l", [r.priority for r in reqs]),
        token_ids=[r.prompt_token_ids for r in reqs],
        ids=[r.request_id for r in reqs],
        source=path.name,
    )
    return wl, rw.scheduler_config()


@pytest.mark.parametrize("name", ["p1_first_batch", "p2_preemption", "p3_prefix_sharing", "p4_priority"])
def test_step_clocked_simulation_equals_replay(name):
    """With every step lasting 1 s, arrival_step k arriving at k s reproduces replay exactly."""
    path = PARITY / f"{name}.workload.json"
    wl, cfg = workload_from_replay(path)
    assert not cfg.async_scheduling
    buf = io.StringIO()
    res = simulate(cfg, wl, ConstantCostModel(1.0), trace_out=buf)
    sim = records(buf)
    ref = replay_records(path)
    assert_same_steps(sim, ref)
    # The virtual clock is replay's step counter.
    for a, b in zip(sim, ref):
        if a["total_tokens"]:
            assert a["sim_time_s"] == b["step"]
            assert a["sim_duration_s"] == 1.0
    assert res.summary["completed"] == len(wl)


def derived_replay_workload(sim: list[dict], wl: Workload, cfg: SchedulerConfig) -> dict:
    """A replay workload where each request arrives at the step the simulator added it.

    In async mode a record's step is the loop turn that scheduled it, and
    its "added" the requests added in that turn, as replay counts them.
    """
    index = {wl.request_id(i): i for i in range(len(wl))}
    reqs = []
    for rec in sim:
        for rid in rec["added"]:
            i = index[rid]
            reqs.append(
                {
                    "id": rid,
                    "arrival_step": rec["step"],
                    "prompt_token_ids": wl.prompt(i),
                    "max_tokens": wl.output_lens[i],
                    "priority": wl.priorities[i] if wl.priorities is not None else 0,
                }
            )
    keys = (
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "block_size",
        "num_gpu_blocks",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "policy",
        "async_scheduling",
    )
    return {"config": {k: getattr(cfg, k) for k in keys}, "requests": reqs}


@pytest.mark.parametrize("name", ["p1_first_batch", "p2_preemption", "p3_prefix_sharing", "p4_priority"])
def test_step_clocked_async_simulation_makes_async_replay_decisions(name):
    """The async parity workloads, 1 s of model time per step: the same steps as an async replay."""
    path = PARITY_ASYNC / f"{name}.workload.json"
    wl, cfg = workload_from_replay(path)
    assert cfg.async_scheduling
    buf = io.StringIO()
    res = simulate(cfg, wl, ConstantCostModel(1.0), trace_out=buf)
    sim = records(buf)
    assert_same_steps(sim, replay_records(derived_replay_workload(sim, wl, cfg)))
    assert res.summary["completed"] == len(wl)
    # No host path: the model never waits, every step with tokens is 1 s of clock.
    for r in sim:
        if r["total_tokens"]:
            assert (r["sim_duration_s"], r["sim_model_s"], r["sim_host_gap_s"]) == (1.0, 1.0, 0.0)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_timed_simulation_makes_replay_decisions(policy, async_scheduling):
    """Poisson arrivals on an H100 cost model, a cache small enough to preempt, shared
    prefixes: replaying with each request arriving at the step it was added gives the
    very same steps (decisions, queues, KV usage, prefix hits), in either mode."""
    cfg = SchedulerConfig(
        num_gpu_blocks=260,
        max_model_len=1024,
        max_num_batched_tokens=512,
        max_num_seqs=16,
        long_prefill_token_threshold=128,
        policy=policy,
        async_scheduling=async_scheduling,
    )
    cost = CostModel(load_model("llama-3-8b"), load_hardware("h100"))
    wl = synthetic_workload(
        160,
        200,
        40,
        request_rate=60.0,
        range_ratio=0.5,
        prefix_len=64,
        num_prefix_groups=3,
        num_priority_levels=3 if policy == "priority" else 1,
        seed=5,
    )
    buf = io.StringIO()
    res = simulate(cfg, wl, cost, trace_out=buf)
    sim = records(buf)
    assert res.num_preemptions > 0
    assert res.prefix_cache_hit_rate > 0.1
    assert any(r["num_waiting"] > 0 for r in sim)
    assert_same_steps(sim, replay_records(derived_replay_workload(sim, wl, cfg)))
    # Time only moves forward, by the cost model's price of each batch.
    times = [r["sim_time_s"] for r in sim]
    assert times == sorted(times)
    assert all(r["sim_duration_s"] > 0 for r in sim if r["total_tokens"])


def test_holding_back_a_long_fcfs_queue_changes_no_decision():
    cfg = SchedulerConfig(num_gpu_blocks=400, max_model_len=512, max_num_batched_tokens=256, max_num_seqs=4)
    wl = synthetic_workload(300, 100, 6, prefix_len=32, num_prefix_groups=2, seed=2)
    cost = ConstantCostModel(0.01)
    a, b = io.StringIO(), io.StringIO()
    ra = simulate(cfg, wl, cost, trace_out=a)
    rb = simulate(cfg, wl, cost, trace_out=b, hold_back=False)
    sa, sb = records(a), records(b)
    assert max(r.get("held_back", 0) for r in sa) > 250
    assert "held_back" not in json.dumps(sb)
    assert compare(sa, sb) == []
    for x, y in zip(sa, sb):
        assert x["num_waiting"] == y["num_waiting"]
        assert x["kv_usage"] == y["kv_usage"]
    assert ra.summary == rb.summary


def one_request_workload(arrival: float, prompt: int, out: int) -> Workload:
    return Workload(array("d", [arrival]), array("l", [prompt]), array("l", [out]))


def test_timestamps_of_a_lone_request():
    cfg = SchedulerConfig(num_gpu_blocks=100, max_model_len=256)
    res = simulate(cfg, one_request_workload(2.0, 10, 5), ConstantCostModel(1.0))
    s = res.summary
    # Idle until 2.0; prefill step ends at 3.0 (first token); four decodes end at 4..7.
    assert s["duration"] == 7.0
    assert s["mean_ttft_ms"] == 1000.0
    assert s["mean_tpot_ms"] == 1000.0
    assert s["mean_itl_ms"] == s["p99_itl_ms"] == 1000.0
    assert s["mean_e2el_ms"] == 5000.0
    assert s["total_output_tokens"] == 5
    assert res.num_busy_steps == 5


def test_idle_engine_jumps_to_the_next_arrival():
    cfg = SchedulerConfig(num_gpu_blocks=100, max_model_len=256)
    wl = Workload(array("d", [0.0, 1000.0]), array("l", [10, 10]), array("l", [3, 3]))
    res = simulate(cfg, wl, ConstantCostModel(0.5))
    assert res.sim_duration_s == 1001.5
    assert res.num_busy_steps == 6
    assert res.summary["mean_e2el_ms"] == 1500.0


def test_max_concurrency_is_a_closed_loop():
    cfg = SchedulerConfig(num_gpu_blocks=200, max_model_len=256)
    wl = Workload(array("d", [0.0] * 4), array("l", [10] * 4), array("l", [3] * 4))
    res = simulate(cfg, wl, ConstantCostModel(1.0), max_concurrency=1, record_series=True)
    # One at a time, each 3 steps; latency measured from when the client sent it.
    assert res.max_running == 1
    assert res.sim_duration_s == 12.0
    assert res.summary["mean_e2el_ms"] == 3000.0
    assert list(res.metrics.start_times) == [0.0, 3.0, 6.0, 9.0]
    free = simulate(cfg, wl, ConstantCostModel(1.0))
    assert free.max_running == 4 and free.sim_duration_s == 3.0


def test_priorities_are_honoured():
    cfg = SchedulerConfig(num_gpu_blocks=200, max_model_len=256, max_num_seqs=1, policy="priority")
    wl = Workload(
        array("d", [0.0, 0.5, 0.5]),
        array("l", [10, 10, 10]),
        array("l", [4, 4, 4]),
        priorities=array("l", [5, 9, 0]),
    )
    buf = io.StringIO()
    simulate(cfg, wl, ConstantCostModel(1.0), trace_out=buf)
    admitted = [a[0] for r in records(buf) for a in r["admitted"]]
    assert admitted == ["0", "2", "1"]


def test_rejected_requests_count_as_failed():
    cfg = SchedulerConfig(num_gpu_blocks=100, max_model_len=64)
    wl = Workload(array("d", [0.0, 0.0]), array("l", [100, 10]), array("l", [4, 4]))
    res = simulate(cfg, wl, ConstantCostModel(1.0))
    assert res.summary["failed"] == 1 and res.summary["completed"] == 1
    assert res.rejections[0][0] == "0" and "max_model_len" in res.rejections[0][1]


def test_outputs_capped_by_max_model_len_are_counted():
    cfg = SchedulerConfig(num_gpu_blocks=100, max_model_len=20)
    res = simulate(cfg, one_request_workload(0.0, 16, 10), ConstantCostModel(1.0))
    assert res.summary["total_output_tokens"] == 4
    assert res.num_length_capped == 1


def test_deployment_run_records_series_and_json():
    dep = build_deployment(DeploymentSpec(model="qwen3-0.6b", hardware="h100", max_num_seqs=64))
    wl = synthetic_workload(200, 256, 16, request_rate=100.0, seed=1)
    res = simulate(dep, wl, record_series=True, goodput_slos_ms={"ttft": 50.0})
    assert len(res.series) == res.num_steps
    assert max(res.series.num_running) == res.max_running <= 64
    assert sum(res.series.decode_tokens) + sum(res.series.prefill_tokens) == sum(
        r for r in (200 * 256, 200 * 15)
    )
    data = res.to_json()
    assert data["completed"] == 200 and data["request_goodput"] is not None
    assert data["deployment"]["model"] == "qwen3-0.6b"
    assert data["simulation"]["num_steps"] == res.num_steps
    assert math.isclose(data["duration"], res.sim_duration_s)
    json.dumps(data)
    assert "Simulation Result" in res.table()


def test_launch_modes_move_the_clock_but_not_the_decisions():
    """Graph, piecewise and eager steps each cost what their mode says, and replay
    still makes the very same decisions (sync: a step pays its launches in full)."""
    cfg = SchedulerConfig(num_gpu_blocks=400, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=16)
    # One millisecond per launch: an eager step adds 320 ms, a piecewise one 96 ms,
    # far more than any of these small batches' kernels take.
    cost = CostModel(
        load_model("llama-3-8b"), load_hardware("h100"), cuda_graph_max_tokens=12, launch_latency_s=1e-3
    )
    wl = synthetic_workload(80, 20, 30, request_rate=20.0, range_ratio=0.5, seed=4)
    buf = io.StringIO()
    simulate(cfg, wl, cost, trace_out=buf)
    sim = records(buf)
    assert_same_steps(sim, replay_records(derived_replay_workload(sim, wl, cfg)))
    seen = set()
    for r in sim:
        if not r["total_tokens"]:
            continue
        decode_only = all(n == 1 for _, n in r["sched"])
        if r["total_tokens"] > 12:
            mode, low, high = "eager", 0.320, 0.400
        elif decode_only:
            mode, low, high = "graph", 0.0, 0.040
        else:
            mode, low, high = "piecewise", 0.096, 0.176
        assert low < r["sim_duration_s"] < high, (r["step"], mode, r["sim_duration_s"])
        seen.add(mode)
    assert seen == {"graph", "piecewise", "eager"}


def _without_wall_times(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        rec = json.loads(line)
        rec.pop("schedule_ns", None)
        rec.pop("update_ns", None)
        out.append(rec)
    return out


def _llama_run(spec: dict, workload: dict, n: int, seed: int, num_prefix_groups: int) -> tuple:
    """llama-3-8b on an H100 (``spec`` overrides) and ``n`` requests of about 1000/60 tokens."""
    dep = build_deployment(DeploymentSpec(model="llama-3-8b", hardware="h100", **spec))
    if "prefix_len" in workload:
        workload = {"num_prefix_groups": num_prefix_groups, **workload}
    return dep, synthetic_workload(n, 1000, 60, seed=seed, **workload)


@pytest.mark.parametrize(
    ("spec", "workload", "kwargs"),
    [
        ({}, {"request_rate": 4.0}, {}),
        ({"num_gpu_blocks": 700, "max_num_seqs": 16}, {"request_rate": 8.0, "prefix_len": 256}, {}),
        ({"max_model_len": 1100}, {"request_rate": 3.0, "range_ratio": 0.5}, {}),
        ({"enable_prefix_caching": False}, {"request_rate": math.inf}, {"max_concurrency": 5}),
        ({"block_size": 32}, {"request_rate": 2.0, "burstiness": 0.3}, {"max_steps": 3000}),
        ({}, {"request_rate": 5.0}, {"frontend": Frontend(1, 2e-5)}),
        ({}, {"request_rate": math.inf}, {"max_concurrency": 6, "frontend": Frontend(2, 4e-5)}),
    ],
)
def test_plain_decode_steps_leave_trace_series_and_figures_unchanged(spec, workload, kwargs, monkeypatch):
    applied = []
    advance = PlainDecodes.advance_decode_steps
    monkeypatch.setattr(
        PlainDecodes, "advance_decode_steps", lambda s, k, t: applied.append(k) or advance(s, k, t)
    )
    dep, wl = _llama_run(spec, workload, 150, seed=3, num_prefix_groups=2)
    runs = []
    for fast in (False, True):
        buf = io.StringIO()
        res = simulate(dep, wl, trace_out=buf, record_series=True, fast_forward=fast, **kwargs)
        plain = simulate(dep, wl, fast_forward=fast, **kwargs)
        data = res.to_json()
        data["simulation"].pop("wall_s")
        data["simulation"].pop("wall_us_per_request")
        quiet = plain.to_json()
        quiet["simulation"].pop("wall_s")
        quiet["simulation"].pop("wall_us_per_request")
        assert quiet == data
        series = {name: list(getattr(res.series, name)) for name in res.series.__slots__}
        runs.append((_without_wall_times(buf.getvalue()), data, series))
    # Most steps were plain ones; the trace, figures and series are still the same.
    assert sum(applied) > runs[0][1]["simulation"]["num_steps"] // 2
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == runs[1][1]
    assert runs[0][2] == runs[1][2]


@pytest.mark.parametrize(
    ("spec", "workload", "cohort_share"),
    [
        ({}, {"request_rate": 30.0}, 0.9),
        # Prompts often chunked: fewer steps keep their decodes lazy.
        ({"max_num_batched_tokens": 2048}, {"request_rate": 40.0, "range_ratio": 0.5}, 0.3),
        # KV-bound: preemptions, and queues held back by the watermark.
        (
            {"num_gpu_blocks": 400, "max_num_seqs": 24, "max_model_len": 2048},
            {"request_rate": 25.0, "prefix_len": 256, "range_ratio": 0.9},
            0.25,
        ),
        (
            {"scheduling_policy": "priority", "max_model_len": 1100},
            {"request_rate": 20.0, "range_ratio": 0.5},
            0.9,
        ),
    ],
)
def test_cohort_steps_under_load_leave_every_figure_and_request_unchanged(
    spec, workload, cohort_share, monkeypatch
):
    cohort_steps = []
    original = DecodeCohort.advance
    monkeypatch.setattr(DecodeCohort, "advance", lambda c, k: cohort_steps.append(k) or original(c, k))
    dep, wl = _llama_run(spec, workload, 300, seed=5, num_prefix_groups=3)
    runs = []
    for fast in (False, True):
        res = simulate(dep, wl, fast_forward=fast, record_requests=True)
        data = res.to_json()
        data["simulation"].pop("wall_s")
        data["simulation"].pop("wall_us_per_request")
        runs.append((data, res.requests))
    # Steps that admit while others decode went through cohorts too, not only plain runs.
    assert spec.get("num_gpu_blocks") is None or runs[0][0]["simulation"]["num_preemptions"]
    assert sum(cohort_steps) > cohort_share * runs[0][0]["simulation"]["num_steps"]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("spec", "workload", "kwargs", "share"),
    [
        ({}, {"request_rate": 4.0}, {}, 0.8),
        ({}, {"request_rate": 30.0, "range_ratio": 0.5}, {}, 0.1),
        # KV-bound: preemptions and queues.
        ({"num_gpu_blocks": 700, "max_num_seqs": 16}, {"request_rate": 8.0, "prefix_len": 256}, {}, 0.1),
        ({"max_model_len": 1100}, {"request_rate": 3.0, "range_ratio": 0.5}, {}, 0.5),
        ({"enable_prefix_caching": False}, {"request_rate": math.inf}, {"max_concurrency": 5}, 0.5),
        ({"block_size": 32}, {"request_rate": 2.0, "burstiness": 0.3}, {"max_steps": 3000}, 0.5),
        ({"scheduling_policy": "priority"}, {"request_rate": 6.0, "num_priority_levels": 3}, {}, 0.5),
        ({}, {"request_rate": 5.0}, {"frontend": Frontend(1, 2e-5)}, 0.5),
        ({}, {"request_rate": math.inf}, {"max_concurrency": 6, "frontend": Frontend(2, 4e-5)}, 0.5),
    ],
)
def test_async_plain_decode_calls_leave_every_figure_and_request_unchanged(
    spec, workload, kwargs, share, monkeypatch
):
    applied, finished = [], []
    advance = PlainDecodes.advance_async_decode_steps

    def counted(s, k, t, through_finish=False):
        done = advance(s, k, t, through_finish)
        applied.append(k)
        finished.extend(done)
        return done

    monkeypatch.setattr(PlainDecodes, "advance_async_decode_steps", counted)
    # Plain calls of a cohort kept across admitting calls count too.
    advance_cohort = PlainDecodes.advance_async_cohort

    def counted_cohort(s, cohort, k, finishing):
        applied.append(k)
        finished.extend(finishing)
        return advance_cohort(s, cohort, k, finishing)

    monkeypatch.setattr(PlainDecodes, "advance_async_cohort", counted_cohort)
    dep, wl = _llama_run({"async_scheduling": True, **spec}, workload, 150, seed=3, num_prefix_groups=2)
    runs = []
    for fast in (False, True):
        res = simulate(dep, wl, fast_forward=fast, record_requests=True, detailed=True, **kwargs)
        data = res.to_json()
        data["simulation"].pop("wall_s")
        data["simulation"].pop("wall_us_per_request")
        runs.append((data, res.requests))
    assert runs[0][0]["simulation"]["async_scheduling"]
    # The per-call path ran alone first; then most calls ran in plain runs, some ending in finishes.
    assert sum(applied) > share * runs[0][0]["simulation"]["num_steps"]
    # Closed loops here finish all their requests at once: no run ends finishing only some.
    assert finished or "max_concurrency" in kwargs
    assert runs[0] == runs[1]


def test_async_trace_and_series_take_every_call():
    # A trace or series needs each call's record: the plain runs stay off and the output is the per-call one.
    dep, wl = _llama_run({"async_scheduling": True}, {"request_rate": 4.0}, 60, seed=1, num_prefix_groups=1)
    out = []
    for fast in (False, True):
        buf = io.StringIO()
        res = simulate(dep, wl, trace_out=buf, record_series=True, fast_forward=fast)
        out.append((_without_wall_times(buf.getvalue()), list(res.series.time), res.num_steps))
    assert out[0] == out[1]


@pytest.mark.parametrize(
    ("spec", "workload", "share"),
    [
        ({}, {"request_rate": 4.0}, 0.03),
        ({}, {"request_rate": 30.0}, 0.3),
        # Prompts often chunked: their calls go through schedule().
        ({"max_num_batched_tokens": 2048}, {"request_rate": 40.0, "range_ratio": 0.5}, 0.05),
        # KV-bound: preemptions, and queues held back by the watermark.
        (
            {"num_gpu_blocks": 400, "max_num_seqs": 24, "max_model_len": 2048},
            {"request_rate": 25.0, "prefix_len": 256, "range_ratio": 0.9},
            0.05,
        ),
        ({"max_model_len": 1100}, {"request_rate": 20.0, "range_ratio": 0.5}, 0.1),
        ({"scheduling_policy": "priority"}, {"request_rate": 20.0, "num_priority_levels": 3}, 0.1),
    ],
)
def test_async_cohort_calls_leave_every_figure_and_request_unchanged(spec, workload, share, monkeypatch):
    calls = []
    update = PlainDecodes.async_cohort_update

    def counted(s, *args):
        calls.append(1)
        return update(s, *args)

    monkeypatch.setattr(PlainDecodes, "async_cohort_update", counted)
    dep, wl = _llama_run({"async_scheduling": True, **spec}, workload, 300, seed=5, num_prefix_groups=3)
    runs = []
    for fast in (False, True):
        res = simulate(dep, wl, fast_forward=fast, record_requests=True, detailed=True)
        data = res.to_json()
        data["simulation"].pop("wall_s")
        data["simulation"].pop("wall_us_per_request")
        runs.append((data, res.requests))
    # The per-call path ran alone first; then calls that admit kept the decodes lazy.
    assert spec.get("num_gpu_blocks") is None or runs[0][0]["simulation"]["num_preemptions"]
    assert len(calls) > share * runs[0][0]["simulation"]["num_steps"], len(calls)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("overlaps", [True, False])
def test_async_decode_runs_under_preemption_leave_every_figure_and_request_unchanged(overlaps, monkeypatch):
    # A KV-bound run (preemptions, queues) with async scheduling: the plain
    # runs' one-loop clock (pricing, pipelining, costs, inter-token gaps) gives
    # the per-call path's figures and per-request lists, host overlapping or not.
    from llmsched.executor.sim.executor import SimExecutor

    calls = []
    run = SimExecutor.run_async_decodes

    def counted(ex, *args):
        ends = run(ex, *args)
        calls.append(len(ends))
        return ends

    monkeypatch.setattr(SimExecutor, "run_async_decodes", counted)
    dep, wl = _llama_run(
        {"async_scheduling": True, "num_gpu_blocks": 250, "max_num_seqs": 8, "max_model_len": 2048},
        {"request_rate": 4.0, "range_ratio": 0.9},
        300,
        seed=7,
        num_prefix_groups=1,
    )
    dep.cost_model.host_overlaps_model = overlaps
    runs = []
    for fast in (False, True):
        res = simulate(dep, wl, fast_forward=fast, record_requests=True, detailed=True)
        data = res.to_json()
        data["simulation"].pop("wall_s")
        data["simulation"].pop("wall_us_per_request")
        runs.append((data, res.requests))
    assert runs[0][0]["simulation"]["num_preemptions"] > 0
    # The per-call path ran alone first; then most calls ran in plain runs.
    assert sum(calls) > 0.5 * runs[0][0]["simulation"]["num_steps"], sum(calls)
    assert runs[0] == runs[1]
