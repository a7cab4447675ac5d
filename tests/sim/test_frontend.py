"""The API servers in front of the engine: requests reach it over time, and the trace says so."""

from __future__ import annotations

import io
import json
from array import array

import pytest

from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import ConfigError
from llmsched.executor.sim.cost_model import ConstantCostModel
from llmsched.sim.deployment import DeploymentSpec, build_deployment
from llmsched.sim.frontend import DEFAULT_TOKEN_S, Frontend
from llmsched.sim.runner import simulate
from llmsched.sim.workload import Workload, synthetic_workload


def inputs_only(count: int, token_s: float = DEFAULT_TOKEN_S) -> Frontend:
    """API servers that pay per prompt token only: the input path alone, in closed form."""
    return Frontend(count, token_s, request_s=0.0, output_token_s=0.0)


def test_servers_take_requests_round_robin_one_at_a_time():
    fe = inputs_only(2, token_s=1e-3)
    done = fe.delivery_times([0.0, 0.0, 0.0, 0.0, 10.0], [100, 200, 100, 100, 50])
    # Server 0: 0.1, then 0.1 + 0.1; server 1: 0.2, then 0.2 + 0.1; then server 0 idle until 10.
    assert list(done) == pytest.approx([0.1, 0.2, 0.2, 0.3, 10.05])


@pytest.mark.parametrize(("count", "token_s"), [(0, 1e-6), (True, 1e-6), (1, -1.0), (1, float("nan"))])
def test_bad_frontend_settings_are_refused(count, token_s):
    with pytest.raises(ConfigError, match=r"api_server_count|per prompt token"):
        Frontend(count, token_s)


def first_steps(frontend: Frontend | None, n: int = 3) -> list[dict]:
    """Seed 000's scenario: 16 prompts of 1024 tokens sent at once, a 16384-token budget."""
    dep = build_deployment(DeploymentSpec(max_num_batched_tokens=16384, max_num_seqs=128))
    wl = synthetic_workload(16, 1024, 16, seed=0)
    buf = io.StringIO()
    simulate(dep, wl, trace_out=buf, frontend=frontend)
    return [json.loads(line) for line in buf.getvalue().splitlines()[1 : 1 + n]]


def test_seed_000_first_batch_is_partial_through_an_api_server_and_whole_offline():
    offline = first_steps(None)
    assert len(offline[0]["sched"]) == 16 and "in_frontend" not in offline[0]
    served = first_steps(inputs_only(1))
    first = served[0]
    assert 1 <= len(first["sched"]) < 16
    # The trace says where the others are: still in the API server.
    assert first["in_frontend"] == 16 - len(first["admitted"])
    assert first["sim_time_s"] > 0.0  # the engine waited for the first request, then stepped at once
    assert sum(len(s["admitted"]) for s in served) <= 16


def test_more_api_servers_deliver_a_burst_sooner():
    one = first_steps(inputs_only(1), 1)[0]
    four = first_steps(inputs_only(4), 1)[0]
    assert four["sim_time_s"] == one["sim_time_s"]  # the first request takes as long either way
    assert (
        inputs_only(4).delivery_times([0.0] * 16, [1024] * 16)[-1]
        < inputs_only(1).delivery_times([0.0] * 16, [1024] * 16)[-1]
    )


def test_closed_loop_clients_send_through_the_api_server_as_slots_free():
    cfg = SchedulerConfig(num_gpu_blocks=200, max_model_len=256)
    wl = Workload(array("d", [0.0] * 4), array("l", [10] * 4), array("l", [3] * 4))
    # One client: each request is sent when the one before it ends, spends
    # 10 tokens x 0.05 s in the API server, then takes 3 steps of 1 s.
    res = simulate(cfg, wl, ConstantCostModel(1.0), max_concurrency=1, frontend=inputs_only(1, 0.05))
    assert list(res.metrics.start_times) == [0.0, 3.5, 7.0, 10.5]
    assert res.summary["mean_e2el_ms"] == pytest.approx(3500.0)
    assert res.summary["mean_ttft_ms"] == pytest.approx(1500.0)
    assert res.sim_duration_s == pytest.approx(14.0)


def test_closed_loop_trace_counts_the_requests_still_in_the_api_server():
    dep = build_deployment(DeploymentSpec(max_num_batched_tokens=16384, max_num_seqs=128))
    wl = synthetic_workload(16, 1024, 16, seed=0)
    buf = io.StringIO()
    res = simulate(dep, wl, trace_out=buf, frontend=inputs_only(1), max_concurrency=4)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()[1:]]
    # Four clients send at once; the first step has the first to get through,
    # and the trace says the other three are still in the API server.
    assert len(lines[0]["admitted"]) == 1 and lines[0]["in_frontend"] == 3
    assert res.summary["completed"] == 16 and res.max_running <= 4


@pytest.mark.parametrize("max_concurrency", [3, 8])
def test_a_free_api_server_changes_nothing_in_a_closed_loop(max_concurrency):
    dep = build_deployment(DeploymentSpec(max_num_batched_tokens=2048, max_num_seqs=8))
    wl = synthetic_workload(60, 512, 24, seed=2, range_ratio=0.5)
    runs = []
    for frontend in (None, inputs_only(2, 0.0)):
        res = simulate(dep, wl, max_concurrency=max_concurrency, frontend=frontend)
        runs.append((res.summary, list(res.metrics.start_times), res.num_steps))
    assert runs[0] == runs[1]


def test_data_parallel_ranks_get_requests_through_the_frontend():
    from llmsched.engine.dp import DPConfig

    dep = build_deployment(DeploymentSpec(data_parallel_size=2))
    wl = synthetic_workload(40, 512, 8, seed=1)
    added = []
    for frontend in (None, inputs_only(1, 2e-6)):
        buf = io.StringIO()
        res = simulate(dep, wl, dp=DPConfig(2, lockstep=False), frontend=frontend, trace_out=buf)
        assert res.summary["completed"] == 40
        lines = [json.loads(line) for line in buf.getvalue().splitlines()[1:]]
        added.append(sum(len(r["added"]) for r in lines if r["group_step"] == 0))
    # Offline, the first (one rank's) step sees its half of the burst; through one API server, one request.
    assert added == [20, 1]
    assert res.to_json()["simulation"]["frontend"] == {
        "api_server_count": 1,
        "seconds_per_request": 0.0,
        "seconds_per_prompt_token": 2e-6,
        "seconds_per_output_token": 0.0,
        "seconds_per_chunk": 0.0,
    }


def test_data_parallel_closed_loop_clients_go_through_the_frontend():
    from llmsched.engine.dp import DPConfig

    dep = build_deployment(DeploymentSpec(data_parallel_size=2))
    wl = synthetic_workload(24, 512, 8, seed=1)
    buf = io.StringIO()
    res = simulate(
        dep,
        wl,
        dp=DPConfig(2, lockstep=False),
        frontend=inputs_only(1, 2e-6),
        max_concurrency=6,
        trace_out=buf,
    )
    assert res.summary["completed"] == 24
    lines = [json.loads(line) for line in buf.getvalue().splitlines()[1:]]
    # Six clients send at once; the first step's rank has only the first request through.
    assert sum(len(r["added"]) for r in lines if r["group_step"] == 0) == 1
    # Each request was sent when a client slot freed: never more than six at a time.
    assert res.max_running <= 6


def test_api_servers_route_for_data_parallel_ranks_and_see_every_request_finish(monkeypatch):
    import llmsched.sim.dp_group as dp_group
    from llmsched.engine.dp import ApiServerRouter, DPConfig

    servers: list[ApiServerRouter] = []
    routed: list[tuple[int, int]] = []

    class Recorded(ApiServerRouter):
        __slots__ = ()

        def __init__(self, *args: int) -> None:
            super().__init__(*args)
            servers.append(self)

        def route(self) -> int:
            rank = super().route()
            routed.append((servers.index(self), rank))
            return rank

    monkeypatch.setattr(dp_group, "ApiServerRouter", Recorded)
    dep = build_deployment(DeploymentSpec(data_parallel_size=3))
    wl = synthetic_workload(60, 256, 8, request_rate=200.0, seed=4, range_ratio=0.5)
    res = simulate(dep, wl, dp=DPConfig(3), frontend=inputs_only(2, 2e-6))
    assert res.summary["completed"] == 60
    # Requests are dealt to the two servers in turn, and each server routes its own.
    assert len(servers) == 2 and [k for k, _ in routed] == [0, 1] * 30
    # Over idle ranks the two start their scans at ranks 0 and 1.
    assert routed[:2] == [(0, 0), (1, 1)]
    # Each server's own count of unfinished requests per rank is back to zero.
    assert [s.inflight for s in servers] == [[0, 0, 0], [0, 0, 0]]
    per_rank = [r["requests"] for r in res.data_parallel["per_rank"]]
    assert per_rank == [sum(1 for _, r in routed if r == k) for k in range(3)]


def test_requests_routed_to_a_full_rank_are_counted():
    from llmsched.engine.dp import DPConfig

    dep = build_deployment(DeploymentSpec(model="qwen3-30b-a3b", data_parallel_size=2, max_num_seqs=4))
    wl = synthetic_workload(80, 256, 32, seed=5, range_ratio=0.8)
    counts = []
    for frontend in (None, inputs_only(1, 2e-6)):
        res = simulate(dep, wl, dp=DPConfig(2), frontend=frontend, max_concurrency=8)
        counts.append(res.data_parallel["sent_to_full_rank"])
        assert ("Sent to a full rank, another had room:", counts[-1]) in res.data_parallel["rows"]
    # Stale snapshots send more of the eight clients' requests to a rank whose
    # four slots are taken while the other has one free than a router that
    # sees both ranks after every step (which misroutes too: it weighs a
    # queued request four times a running one).
    assert 0 < counts[0] < counts[1] < 80


def test_a_streaming_server_works_through_inputs_and_outputs_in_arrival_order():
    from llmsched.sim.frontend import ApiServers

    api = ApiServers(Frontend(1, token_s=0.01, request_s=0.1, output_token_s=0.05))
    # Two requests of 10 tokens sent at 0: 0.1 + 10 x 0.01 each, one after the other.
    assert api.commit(0.0, 10) == pytest.approx(0.2)
    assert api.commit(0.0, 10) == pytest.approx(0.4)
    # A step's 2 tokens made at 0.3 wait for the second input: seen at 0.4 + 2 x 0.05.
    assert api.output(0.3, 2) == pytest.approx(0.5)
    assert api.seen(0.3) == pytest.approx(0.5)
    assert api.seen(0.2) == 0.2  # nothing was streamed before it
    assert api.seen(1.0) == 1.0  # the server was idle again by then
    assert api.last_seen == pytest.approx(0.5)


def test_outputs_queued_together_share_their_chunks():
    from llmsched.sim.frontend import ApiServers

    # 0.05 s a streamed token, of which 0.03 s is its chunk's.
    api = ApiServers(Frontend(1, token_s=0.0, request_s=1.0, output_token_s=0.05, chunk_s=0.03))
    api.commit(0.0, 10)  # busy until 1.0
    # Steps at 0.1 and 0.2 of 2 streams each queue together behind the input:
    # the first pays 2 x 0.05, the second only its tokens' 2 x 0.02.
    assert api.output(0.1, 2) == pytest.approx(1.1)
    assert api.output(0.2, 2) == pytest.approx(1.14)
    # A third stream joins: one more chunk.
    assert api.output(0.3, 3) == pytest.approx(1.14 + 3 * 0.02 + 0.03)
    # Once that queue has started, a new step's output needs chunks of its own.
    assert api.output(1.5, 2) == pytest.approx(1.6)
    with pytest.raises(ConfigError, match="per SSE chunk"):
        Frontend(1, output_token_s=1e-5, chunk_s=2e-5)


def test_streaming_servers_share_a_step_output_evenly():
    from llmsched.sim.frontend import ApiServers

    api = ApiServers(Frontend(2, token_s=0.0, request_s=0.0, output_token_s=0.1))
    # 4 tokens over two servers: 2 x 0.1 each, both from 1.0.
    assert api.output(1.0, 4) == pytest.approx(1.2)
    assert api.free == pytest.approx([1.2, 1.2])


def one_engine_run(frontend: Frontend, out_lens: list[int], sent: list[float], step_s: float = 1.0, **kwargs):
    """Requests of 10 prompt tokens sent at ``sent`` to an engine whose every step takes ``step_s``."""
    cfg = SchedulerConfig(num_gpu_blocks=2000, max_model_len=256)
    n = len(out_lens)
    wl = Workload(array("d", sent), array("l", [10] * n), array("l", out_lens))
    return simulate(cfg, wl, ConstantCostModel(step_s), frontend=frontend, record_requests=True, **kwargs)


@pytest.mark.parametrize(
    ("output_token_s", "ttft", "e2el"),
    [
        # Tokens made at 1.5, 2.5, 3.5, each streamed in 0.5 s: seen at 2.0, 3.0, 4.0.
        (0.5, 2.0, 4.0),
        # 1.5 s a token: the server falls behind the engine (seen at 3.0, 4.5, 6.0).
        (1.5, 3.0, 6.0),
    ],
)
def test_the_client_sees_each_token_when_its_server_has_streamed_it(output_token_s, ttft, e2el):
    fe = Frontend(1, token_s=0.05, request_s=0.0, output_token_s=output_token_s)
    res = one_engine_run(fe, [3], [0.0])
    # The prompt takes 10 x 0.05 s, then three 1 s steps from 0.5.
    assert res.summary["mean_ttft_ms"] == pytest.approx(ttft * 1e3)
    assert res.summary["mean_e2el_ms"] == pytest.approx(e2el * 1e3)
    assert res.summary["mean_tpot_ms"] == pytest.approx((e2el - ttft) / 2 * 1e3)
    assert res.sim_duration_s == pytest.approx(e2el)
    # Its work: the prompt, then each token's own chunk (none queued behind another).
    assert res.to_json()["simulation"]["frontend"]["busy_s"] == pytest.approx(0.5 + 3 * output_token_s)


def test_a_request_waits_behind_output_the_server_had_before_it():
    fe = Frontend(1, token_s=0.05, request_s=0.0, output_token_s=1.0)
    res = one_engine_run(fe, [2, 1], [0.0, 2.0])
    # Request 0 reaches the engine at 0.5; its tokens come at 1.5 (streamed 1.5-2.5) and 2.5.
    # Request 1, sent at 2.0, waits for that stream: it reaches the engine at 2.5 + 0.5,
    # before the token made at 2.5 (streamed 3.0-4.0); its own token, made at 4.0, is seen at 5.0.
    (r0, r1) = sorted(res.requests, key=lambda r: r[1])
    assert r0[1:4] == pytest.approx((0.0, 2.5, 4.0))
    assert r1[1:4] == pytest.approx((2.0, 5.0, 5.0))
    assert res.sim_duration_s == pytest.approx(5.0)
    # Without the output path the server is free at 2.0: its token is made at 3.5 and seen then.
    res = one_engine_run(inputs_only(1, 0.05), [2, 1], [0.0, 2.0])
    assert sorted(res.requests, key=lambda r: r[1])[1][1:4] == pytest.approx((2.0, 3.5, 3.5))


def test_a_closed_loop_client_sends_when_it_has_seen_the_last_token():
    fe = Frontend(1, token_s=0.0, request_s=0.0, output_token_s=1.0)
    res = one_engine_run(fe, [1, 1], [0.0, 0.0], max_concurrency=1)
    # Made at 1.0, seen at 2.0: the second request goes then, its token is seen at 4.0.
    assert list(res.metrics.start_times) == [0.0, 2.0]
    assert res.sim_duration_s == pytest.approx(4.0)


def test_streaming_servers_cap_a_burst_of_short_requests():
    def run(fe: Frontend) -> dict:
        # 200 requests at once; the engine steps every 0.1 ms.
        return one_engine_run(fe, [4] * 200, [0.0] * 200, step_s=1e-4).summary

    quick = run(inputs_only(1, 0.0))
    # 2 ms a request: the server, not the engine, sets the pace (500 requests/s at most).
    res = run(Frontend(1, 0.0, 2e-3, 0.0))
    # And 1 ms per streamed token, each its own chunk: 200 x (2 ms + 4 x 1 ms) of work, 1000/6 requests/s.
    slow = run(Frontend(1, 0.0, 2e-3, 1e-3, chunk_s=0.0))
    # Half of it per chunk: the outputs queue up behind the burst's inputs and share
    # chunks, so at best 200 x (2 ms + 4 x 0.5 ms), 250 requests/s.
    merged = run(Frontend(1, 0.0, 2e-3, 1e-3, chunk_s=0.5e-3))
    assert quick["request_throughput"] > 1000
    assert 450 < res["request_throughput"] <= 500
    assert 150 < slow["request_throughput"] <= 1000 / 6 + 1e-9
    assert 1000 / 6 < merged["request_throughput"] <= 250 + 1e-9
    assert slow["mean_ttft_ms"] > res["mean_ttft_ms"] > quick["mean_ttft_ms"]


def test_data_parallel_ranks_stream_through_the_api_servers():
    from llmsched.engine.dp import DPConfig

    dep = build_deployment(DeploymentSpec(data_parallel_size=2))
    wl = synthetic_workload(40, 512, 8, seed=1)
    plain = simulate(dep, wl, dp=DPConfig(2, lockstep=False), frontend=inputs_only(2, 2e-6)).summary
    res = simulate(dep, wl, dp=DPConfig(2, lockstep=False), frontend=Frontend(2, 2e-6, 0.0, 5e-3)).summary
    assert res["completed"] == 40
    assert res["mean_tpot_ms"] > plain["mean_tpot_ms"] and res["duration"] > plain["duration"]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(
    ("rate", "max_concurrency"), [(30.0, None), (float("inf"), None), (float("inf"), 12)]
)
def test_fast_paths_give_the_per_call_results_through_streaming_servers(
    async_scheduling, rate, max_concurrency, monkeypatch
):
    from llmsched.core.plain_decodes import PlainDecodes

    fast_calls = []
    for name in (
        "advance_decode_steps",
        "advance_cohort",
        "advance_async_decode_steps",
        "advance_async_cohort",
    ):
        original = getattr(PlainDecodes, name)

        def counted(*args, _original=original, **kw):
            fast_calls.append(1)
            return _original(*args, **kw)

        monkeypatch.setattr(PlainDecodes, name, counted)
    dep = build_deployment(
        DeploymentSpec(
            model="llama-3-8b", hardware="h100", async_scheduling=async_scheduling, max_num_seqs=32
        )
    )
    wl = synthetic_workload(120, 600, 40, request_rate=rate, seed=3, range_ratio=0.5)
    # 1 ms a request and 0.2 ms a token: the server is busy, and behind, for much of the run.
    fe = Frontend(1, 1e-6, 1e-3, 2e-4)
    runs = []
    for fast in (False, True):
        assert not fast_calls  # the per-call path runs every step through the engine
        res = simulate(
            dep, wl, frontend=fe, max_concurrency=max_concurrency, fast_forward=fast, record_requests=True
        )
        data = res.to_json()
        for key in ("wall_s", "wall_us_per_request"):
            data["simulation"].pop(key)
        runs.append((data, res.requests))
    assert fast_calls  # the fast paths ran
    assert runs[0] == runs[1]
    assert runs[0][0]["simulation"]["frontend"]["seconds_per_output_token"] == 2e-4
