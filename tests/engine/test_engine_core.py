"""EngineCore: queueing with rejections, aborts, the step cycle, what executors see, ReplayExecutor."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import pytest

from llmsched.core import (
    ModelRunnerOutput,
    Request,
    RequestRejected,
    RequestStatus,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from llmsched.engine import EngineCore, EngineStep, Executor
from llmsched.executor.replay import ReplayExecutor


@dataclass
class Seen:
    """What one execute() call received, copied at call time."""

    scheduled: list[tuple[str, int]]
    finished_req_ids: list[str]
    preempted: list[str]


@dataclass
class RecordingExecutor:
    """Fabricates like ReplayExecutor and records every batch it is handed."""

    token: int = 7
    calls: list[Seen] = field(default_factory=list)
    closed: bool = False

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One token per request that finished its known tokens."""
        so = scheduler_output
        self.calls.append(
            Seen(
                [(r.request_id, n) for r, n in zip(so.scheduled, so.num_scheduled_tokens)],
                list(so.finished_req_ids),
                [r.request_id for r in so.preempted],
            )
        )
        return ModelRunnerOutput(
            [[self.token] if r.num_computed_tokens >= r.num_tokens else [] for r in so.scheduled]
        )

    def close(self) -> None:
        """Remember that the engine closed us."""
        self.closed = True


def make_config(**overrides: object) -> SchedulerConfig:
    """A small config over 4-token blocks with invariants checked every step."""
    settings: dict[str, object] = {
        "num_gpu_blocks": 65,
        "max_model_len": 64,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 8,
        "block_size": 4,
        "debug": True,
    }
    settings.update(overrides)
    return SchedulerConfig(**settings)


def make_engine(**overrides: object) -> tuple[EngineCore, RecordingExecutor]:
    """An engine around a recording executor."""
    ex = RecordingExecutor()
    return EngineCore(make_config(**overrides), ex), ex


def make_req(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    """A request whose prompt is unique to its id."""
    base = (zlib.crc32(rid.encode()) % 100_000) * 1_000
    return Request(
        rid, [base + j for j in range(prompt_len)], SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def test_recording_executor_satisfies_the_protocol() -> None:
    assert isinstance(RecordingExecutor(), Executor)
    assert isinstance(ReplayExecutor(), Executor)


# ---- adding and aborting ------------------------------------------------------------------


def test_add_requests_returns_the_rejected_and_queues_the_rest() -> None:
    engine, _ = make_engine()
    good1, dup, empty, good2, long = (
        make_req("a", 4),
        make_req("a", 5),
        make_req("e", 0),
        make_req("b", 4),
        make_req("l", 64),
    )
    rejected = engine.add_requests([good1, dup, empty, good2, long])
    assert [r for r, _ in rejected] == [dup, empty, long]
    assert all(isinstance(e, RequestRejected) for _, e in rejected)
    messages = [str(e) for _, e in rejected]
    assert "already in use" in messages[0]
    assert "empty" in messages[1]
    assert "max_model_len" in messages[2]
    assert [r.request_id for r in engine.scheduler.waiting] == ["a", "b"]
    assert engine.scheduler.requests["a"] is good1
    es = engine.step()
    assert es.scheduler_output.num_scheduled_tokens_by_id() == {"a": 4, "b": 4}


def test_add_requests_with_nothing_rejected() -> None:
    engine, _ = make_engine()
    assert engine.add_requests(make_req(f"r{k}", 3) for k in range(3)) == []
    assert engine.has_unfinished_requests()


def test_add_request_raises_on_rejection() -> None:
    engine, _ = make_engine()
    engine.add_request(make_req("a", 4))
    with pytest.raises(RequestRejected, match="'a'"):
        engine.add_request(make_req("a", 4))
    assert len(engine.scheduler.waiting) == 1


def test_abort_running_and_waiting_and_unknown() -> None:
    engine, ex = make_engine(max_num_seqs=1)
    engine.add_requests([make_req("a", 4, max_tokens=10), make_req("b", 4), make_req("c", 4)])
    engine.step()
    aborted = engine.abort(["a", "b", "nope"])
    assert sorted(r.request_id for r in aborted) == ["a", "b"]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    assert engine.abort("a") == []  # already finished: ignored
    es = engine.step()
    assert sorted(ex.calls[-1].finished_req_ids) == ["a", "b"]
    assert es.scheduler_output.num_scheduled_tokens_by_id() == {"c": 4}


# ---- the step ------------------------------------------------------------------------------


def test_step_returns_timings_and_post_schedule_counts() -> None:
    engine, _ = make_engine(max_num_seqs=2)
    engine.add_requests([make_req("a", 4, max_tokens=1), make_req("b", 4, max_tokens=3), make_req("c", 4)])
    es = engine.step()
    assert isinstance(es, EngineStep)
    for name in ("schedule_ns", "execute_ns", "update_ns"):
        value = getattr(es, name)
        assert isinstance(value, int) and value >= 0, name
    assert es.schedule_ns > 0
    # Counted right after schedule(): "a" still runs although it finished in
    # this very step's update.
    assert (es.num_running, es.num_waiting) == (2, 1)
    assert [r.request_id for r in es.outputs.finished] == ["a"]
    assert engine.scheduler.get_request_counts() == (1, 1)
    # 2 of 64 usable blocks held right after schedule().
    assert es.kv_usage == 2 / 64
    assert es.model_output.sampled_token_ids == [[7], [7]]


def test_step_outputs_report_new_tokens_and_finishes() -> None:
    engine, _ = make_engine()
    r = make_req("a", 4, max_tokens=2)
    engine.add_request(r)
    es = engine.step()
    assert es.outputs.updated == [r] and es.outputs.finished == []
    es = engine.step()
    assert es.outputs.finished == [r]
    assert r.output_token_ids == [7, 7]
    assert engine.has_requests() and not engine.has_unfinished_requests()
    engine.step()
    assert not engine.has_requests()


def test_executor_receives_finished_ids_once() -> None:
    engine, ex = make_engine()
    engine.add_requests([make_req("a", 4, max_tokens=1), make_req("b", 4, max_tokens=3)])
    engine.step()
    engine.step()
    engine.step()
    assert [c.finished_req_ids for c in ex.calls] == [[], ["a"], []]


def test_executor_receives_preempted_requests() -> None:
    # 6 usable blocks: a and b each hold 3 after their first decode; in the
    # fifth decode step a needs a 4th block and b (last admitted) is preempted.
    engine, ex = make_engine(num_gpu_blocks=7, max_num_batched_tokens=16)
    engine.add_requests([make_req("a", 8, max_tokens=16), make_req("b", 8, max_tokens=16)])
    preempting = None
    for k in range(10):
        es = engine.step()
        if es.scheduler_output.preempted:
            preempting = k
            break
    assert preempting == 5
    assert ex.calls[-1].preempted == ["b"]
    assert ex.calls[-1].scheduled == [("a", 1)]


def test_empty_step_skips_the_executor() -> None:
    engine, ex = make_engine()
    es = engine.step()
    assert ex.calls == []
    assert es.scheduler_output.scheduled == []
    assert es.model_output.sampled_token_ids == ()
    assert es.outputs.updated == [] and es.outputs.finished == []


def test_gated_step_with_nothing_scheduled_skips_the_executor() -> None:
    engine, ex = make_engine()
    engine.scheduler.admission_gate = lambda sched: "held"
    engine.add_request(make_req("a", 4))
    es = engine.step()
    assert es.scheduler_output.total_num_scheduled_tokens == 0
    assert ex.calls == []


def test_empty_batch_still_reaches_the_executor_to_drop_state() -> None:
    engine, ex = make_engine()
    engine.add_request(make_req("a", 4, max_tokens=1))
    engine.step()
    assert len(ex.calls) == 1
    # Nothing to run, but "a" finished: the executor must hear about it.
    es = engine.step()
    assert es.scheduler_output.scheduled == []
    assert len(ex.calls) == 2
    assert ex.calls[-1] == Seen([], ["a"], [])
    # And only once.
    engine.step()
    assert len(ex.calls) == 2


def test_abort_of_a_waiting_request_reaches_the_executor() -> None:
    engine, ex = make_engine()
    engine.scheduler.admission_gate = lambda sched: "held"
    engine.add_request(make_req("a", 4))
    engine.step()
    assert ex.calls == []
    engine.abort("a")
    engine.step()
    assert ex.calls == [Seen([], ["a"], [])]


def test_close_closes_the_executor() -> None:
    engine, ex = make_engine()
    engine.close()
    assert ex.closed


def test_engine_runs_a_batch_to_completion_without_leaks() -> None:
    engine, ex = make_engine(num_gpu_blocks=12, max_num_batched_tokens=16)
    reqs = [make_req(f"r{k}", 3 + 2 * k, max_tokens=2 + k) for k in range(6)]
    assert engine.add_requests(reqs) == []
    steps = 0
    while engine.has_requests():
        engine.step()
        steps += 1
        assert steps < 500
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert engine.scheduler.kv.num_free_blocks == 11
    assert sorted(rid for c in ex.calls for rid in c.finished_req_ids) == sorted(r.request_id for r in reqs)


# ---- ReplayExecutor -----------------------------------------------------------------------


def test_replay_executor_samples_only_for_requests_done_with_known_tokens() -> None:
    engine = EngineCore(make_config(max_num_batched_tokens=16), ReplayExecutor(sample_token_id=5))
    engine.add_requests([make_req("a", 10), make_req("b", 10)])
    es = engine.step()
    # a: whole prompt (samples); b: a 6-token partial chunk (samples nothing).
    assert es.scheduler_output.num_scheduled_tokens_by_id() == {"a": 10, "b": 6}
    assert list(es.model_output.sampled_token_ids) == [(5,), ()]
    es = engine.step()
    assert list(es.model_output.sampled_token_ids) == [(5,), (5,)]
    assert engine.scheduler.requests["b"].output_token_ids == [5]


def test_replay_executor_per_request_tokens() -> None:
    ex = ReplayExecutor(sample_token_id=5, token_by_request={"b": 11})
    engine = EngineCore(make_config(), ex)
    engine.add_requests([make_req("a", 4), make_req("b", 4)])
    es = engine.step()
    assert list(es.model_output.sampled_token_ids) == [(5,), (11,)]


def test_replay_executor_default_token_is_seven() -> None:
    engine = EngineCore(make_config(), ReplayExecutor())
    r = make_req("a", 4, max_tokens=3)
    engine.add_request(r)
    while engine.has_requests():
        engine.step()
    assert r.output_token_ids == [7, 7, 7]
    engine.close()  # a no-op that must not fail


def test_replay_executor_with_nothing_scheduled() -> None:
    out = ReplayExecutor().execute(SchedulerOutput(step=0))
    assert list(out.sampled_token_ids) == []
