"""Real ranks: one process each, over gloo on loopback. Same outputs as one engine; faults fail fast.

Every test here is bounded: the transport's start-up, collective and stall
timeouts are a few seconds, and each loop below has its own deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmsched.core import Request, SamplingParams, SchedulerConfig
from llmsched.engine.dp import DPConfig, DPEngine, DPRankError
from llmsched.engine.dp.factories import ReplayEngineFactory, TorchEngineFactory
from llmsched.engine.dp.proc_transport import ProcessTransport
from llmsched.engine.engine_core import EngineCore

REPLAY_CFG = SchedulerConfig(
    num_gpu_blocks=512, max_model_len=4096, max_num_batched_tokens=256, max_num_seqs=4
)


# Upper bounds on waits only catch a hang: a loaded host may be slow, never
# this slow. What each failure was caught by is asserted on its message.
HANG_S = 60.0


def start(factory: object, dp: DPConfig, **kw: object) -> ProcessTransport:
    kw.setdefault("startup_timeout_s", 60.0)
    kw.setdefault("collective_timeout_s", 2.0)
    kw.setdefault("stall_timeout_s", 6.0)
    return ProcessTransport(factory, dp, **kw)  # type: ignore[arg-type]


def long_requests(n: int) -> list[Request]:
    return [
        Request(str(i), list(range(10 + i, 60)), SamplingParams(max_tokens=3000, ignore_eos=True))
        for i in range(n)
    ]


def step_until_failure(eng: DPEngine, limit_s: float) -> tuple[DPRankError, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            eng.step(timeout=0.5)
        except DPRankError as e:
            return e, time.monotonic() - t0
    raise AssertionError(f"no failure reported within {limit_s} s")


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen3 small enough to load in a blink, saved as a Hugging Face folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.5,
        torch_dtype="float32",
    )
    torch.manual_seed(7)
    d = tmp_path_factory.mktemp("tiny_qwen3")
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_torch_ranks_over_gloo_give_the_single_engines_greedy_outputs(
    tiny_model: Path, async_scheduling: bool
) -> None:
    from llmsched.engine.args import EngineArgs

    args = EngineArgs(
        async_scheduling=async_scheduling,
        model=str(tiny_model),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_batched_tokens=48,  # forces chunked prefills
        max_num_seqs=3,
        num_gpu_blocks_override=96,
        num_threads=1,
    )
    prompts = [[(5 * i + 3 * j) % 120 + 1 for j in range(6 + 7 * i)] for i in range(8)]

    def requests() -> list[Request]:
        return [
            Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]

    single = TorchEngineFactory(args)(0, 1)
    assert isinstance(single, EngineCore)
    for r in requests():
        single.add_request(r)
    expected: dict[str, list[int]] = {}
    while single.has_requests():
        es = single.step()
        for r in es.outputs.finished if es is not None else ():
            expected[r.request_id] = r.output_token_ids
    single.close()
    assert len({tuple(v) for v in expected.values()}) > 1  # the model says different things

    dp = DPConfig(2, lockstep=True, balance_scheduling=True)
    eng = DPEngine(start(TorchEngineFactory(args, threads_per_rank=1), dp))
    try:
        ranks = eng.add_requests(requests())
        assert sorted(ranks) == [0, 0, 0, 0, 1, 1, 1, 1]
        t0 = time.monotonic()
        while eng.has_unfinished_requests():
            assert time.monotonic() - t0 < HANG_S, "the DP engine did not finish"
            eng.step(timeout=1.0)
    finally:
        eng.close()
    got = {rid: res.token_ids for rid, res in eng.results.items()}
    assert got == expected
    assert all(res.finish_reason == "length" for res in eng.results.values())


def test_lockstep_replay_ranks_run_several_waves_and_match_one_engine() -> None:
    eng = DPEngine(
        start(ReplayEngineFactory(REPLAY_CFG), DPConfig(2, lockstep=True, prefill_schedule_interval=2))
    )
    try:
        for wave in range(3):
            reqs = [
                Request(
                    f"w{wave}-{i}", list(range(20 + i)), SamplingParams(max_tokens=3 + i, ignore_eos=True)
                )
                for i in range(5)
            ]
            eng.add_requests(reqs)
            t0 = time.monotonic()
            while eng.has_unfinished_requests():
                assert time.monotonic() - t0 < HANG_S
                eng.step(timeout=1.0)
            # The group goes idle between waves (once every rank said so) and the next request restarts it.
            while eng.transport.group_running:  # type: ignore[attr-defined]
                assert time.monotonic() - t0 < HANG_S
                eng.step(timeout=0.2)
            # Lock-stepped: both ranks ran exactly as many steps, whatever their share of work.
            steps = [r.steps for r in eng.transport.ranks]  # type: ignore[attr-defined]
            assert steps[0] == steps[1] > 0
    finally:
        eng.close()
    assert len(eng.results) == 15
    for rid, res in eng.results.items():
        i = int(rid.split("-")[1])
        assert res.token_ids == [7] * (3 + i) and res.finish_reason == "length"
    assert eng.transport.wave == 3  # type: ignore[attr-defined]


def test_a_killed_rank_fails_the_engine_within_seconds_naming_it() -> None:
    tr = start(ReplayEngineFactory(REPLAY_CFG, step_delay_s=0.02), DPConfig(2, lockstep=True))
    eng = DPEngine(tr)
    pids = tr.pids()
    try:
        eng.add_requests(long_requests(4))
        for _ in range(5):
            eng.step(timeout=2.0)
        os.kill(pids[1], signal.SIGKILL)
        err, _ = step_until_failure(eng, HANG_S)
    finally:
        eng.close()
    assert err.rank == 1
    # Caught by its death, not by its peer's exchange timeout or the watchdog.
    assert "data-parallel rank 1 failed" in str(err) and "killed by SIGKILL" in str(err)
    assert sorted(o.request_id for o in err.outputs) == ["0", "1", "2", "3"]
    assert all(o.finish_reason == "error" and o.error for o in err.outputs)
    owned_by_1 = [o for o in err.outputs if eng.results[o.request_id].rank == 1]
    assert owned_by_1 and all("rank 1 failed" in o.error for o in owned_by_1)
    assert all(eng.results[o.request_id].finish_reason == "error" for o in err.outputs)
    # The survivor does not linger.
    assert all(gone(p) for p in pids)
    with pytest.raises(DPRankError, match="rank 1"):
        eng.step()


def test_a_hung_rank_is_named_once_its_peer_times_out_in_the_exchange() -> None:
    # The watchdog waits far longer than the exchange: only the exchange can name the hung rank.
    tr = start(
        ReplayEngineFactory(REPLAY_CFG, step_delay_s=0.02),
        DPConfig(2, lockstep=True),
        stall_timeout_s=10 * HANG_S,
    )
    eng = DPEngine(tr)
    pids = tr.pids()
    try:
        eng.add_requests(long_requests(2))
        for _ in range(3):
            eng.step(timeout=2.0)
        os.kill(pids[1], signal.SIGSTOP)
        err, took = step_until_failure(eng, HANG_S)
    finally:
        eng.close()
        with pytest.raises(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
    assert err.rank == 1
    assert "stopped responding" in str(err) and "rank 0 timed out waiting for it" in str(err)
    # Not before the 2 s collective timeout expired.
    assert took >= 2.0
    assert all(gone(p) for p in pids)


def test_independent_ranks_have_a_watchdog_for_a_silent_rank() -> None:
    tr = start(
        ReplayEngineFactory(REPLAY_CFG, step_delay_s=0.02), DPConfig(2, lockstep=False), stall_timeout_s=2.0
    )
    eng = DPEngine(tr)
    pids = tr.pids()
    try:
        eng.add_requests(long_requests(2))
        for _ in range(3):
            eng.step(timeout=2.0)
        os.kill(pids[0], signal.SIGSTOP)
        err, took = step_until_failure(eng, HANG_S)
    finally:
        eng.close()
    # The watchdog's message: no exchange (independent ranks) could have caught it.
    assert err.rank == 0 and "no report for" in str(err)
    # Not before the 2 s stall timeout (less the age of the rank's last report, a step or so).
    assert took >= 1.0
    assert all(gone(p) for p in pids)


class _FailsOnRank1:
    """A factory that cannot build rank 1 (module level: it travels pickled)."""

    def __call__(self, rank: int, prefill_schedule_interval: int) -> EngineCore:
        if rank == 1:
            raise RuntimeError("no device for rank 1")
        return ReplayEngineFactory(REPLAY_CFG)(rank, prefill_schedule_interval)


def test_a_rank_that_cannot_start_is_reported_with_its_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(DPRankError) as info:
        start(_FailsOnRank1(), DPConfig(2, lockstep=False), startup_timeout_s=10 * HANG_S)
    assert info.value.rank == 1
    assert "failed to start: RuntimeError: no device for rank 1" in str(info.value)
    # Reported as it happened, long before the start-up timeout.
    assert time.monotonic() - t0 < HANG_S


def test_ranks_exit_when_the_front_end_disappears() -> None:
    tr = start(ReplayEngineFactory(REPLAY_CFG), DPConfig(2, lockstep=False))
    pids = tr.pids()
    # Drop the connections without a Shutdown, as a crashed front end would.
    for r in tr.ranks:
        r.conn.close()  # type: ignore[union-attr]
    t0 = time.monotonic()
    while not all(r.process.exitcode is not None for r in tr.ranks):  # type: ignore[union-attr]
        assert time.monotonic() - t0 < HANG_S, "ranks outlived their front end"
        time.sleep(0.05)
    assert [r.process.exitcode for r in tr.ranks] == [4, 4]  # type: ignore[union-attr]
    tr.close()
    assert all(gone(p) for p in pids)


def test_bench_throughput_runs_over_two_rank_processes(use_embedded: Path, tmp_path: Path, capsys) -> None:
    from llmsched.cli import main

    out = tmp_path / "dp.json"
    rc = main(
        [
            "bench",
            "throughput",
            "--data-parallel-size",
            "2",
            "--data-parallel-mode",
            "lockstep",
            "--balance-scheduling",
            "--num-prompts",
            "6",
            "--input-len",
            "32",
            "--output-len",
            "5",
            "--max-num-seqs",
            "2",
            "--disable-tqdm",
            "--result-json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "2 ranks, lock-step" in text and "Requests per rank: 3/3" in text
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["total_output_tokens"] == 30
    dp = data["data_parallel"]
    assert dp["balance_scheduling"] and dp["mode"] == "lockstep" and dp["requests_per_rank"] == [3, 3]
    assert data["random_weights"] is True


def test_a_rank_started_by_hand_joins_through_the_printed_command() -> None:
    started: list[subprocess.Popen] = []

    def launch(text: str) -> None:
        # "... LLMSCHED_DP_AUTHKEY=<hex> python -m llmsched.engine.dp.worker --front-end H:P --rank R"
        words = text.split()
        key = next(w for w in words if w.startswith("LLMSCHED_DP_AUTHKEY=")).split("=", 1)[1]
        front = words[words.index("--front-end") + 1]
        env = {**os.environ, "LLMSCHED_DP_AUTHKEY": key}
        cmd = [sys.executable, "-m", "llmsched.engine.dp.worker", "--front-end", front, "--rank", "1"]
        started.append(subprocess.Popen(cmd, env=env))

    tr = start(ReplayEngineFactory(REPLAY_CFG), DPConfig(2, lockstep=False), spawn_ranks=[0], announce=launch)
    eng = DPEngine(tr)
    try:
        assert len(started) == 1 and tr.ranks[1].pid == started[0].pid
        eng.add_requests(
            [Request(str(i), [1, 2, 3, i], SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(4)]
        )
        results = eng.run(timeout=1.0)
    finally:
        eng.close()
    assert {r.rank for r in results.values()} == {0, 1}
    assert all(r.token_ids == [7] * 4 for r in results.values())
    assert started[0].wait(timeout=10) == 0
