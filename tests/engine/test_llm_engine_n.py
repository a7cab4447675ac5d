"""LLMEngine.add_request with n > 1: a parent request forked into children, streamed, aborted, traced."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsched.core import RequestRejected, SamplingParams
from llmsched.core.trace import Reason
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.outputs import RequestOutput, RequestOutputKind

FINAL = RequestOutputKind.FINAL_ONLY

# Every test runs with the engine's scheduling in both modes.
pytestmark = pytest.mark.usefixtures("scheduling_mode")


def make_engine(model_dir: Path, fake_factory, **kwargs: object) -> LLMEngine:
    """An engine over the byte-level test model and a FakeExecutor."""
    return LLMEngine(EngineArgs(model=str(model_dir), **kwargs), executor_factory=fake_factory())


def drain(engine: LLMEngine) -> list[RequestOutput]:
    """Step until idle; every output, in order."""
    outs: list[RequestOutput] = []
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return outs
        outs.extend(engine.step())
    raise AssertionError("the engine never went idle")


def test_streamed_children_report_under_the_parent_and_finish_together(
    byte_model_dir: Path, fake_factory
) -> None:
    # Two sequences at a time: child 2 starts, and finishes, after the others.
    engine = make_engine(byte_model_dir, fake_factory, max_num_seqs=2)
    engine.add_request("p", "abc", SamplingParams(n=3, max_tokens=4), output_kind=RequestOutputKind.DELTA)
    assert engine.get_num_unfinished_requests() == 3
    outs = drain(engine)
    assert {o.request_id for o in outs} == {"p"}
    # Each output carries one child's delta, under that child's index.
    assert all(len(o.outputs) == 1 for o in outs)
    texts = dict.fromkeys(range(3), "")
    for o in outs:
        texts[o.outputs[0].index] += o.outputs[0].text
    assert texts == {0: "defg", 1: "defg", 2: "defg"}
    # finished only once, on the very last output, after every child's final delta.
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    finals = [o.outputs[0].index for o in outs if o.outputs[0].finish_reason == "length"]
    assert finals == [0, 1, 2]
    assert outs[-1].outputs[0].index == 2 and outs[-1].outputs[0].finish_reason == "length"


def test_cumulative_children_grow_to_their_final_text(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("p", "k", SamplingParams(n=2, max_tokens=3))
    last: dict[int, str] = {}
    for o in drain(engine):
        (c,) = o.outputs
        assert c.text.startswith(last.get(c.index, ""))
        last[c.index] = c.text
    assert last == {0: "lmn", 1: "lmn"}


def test_final_only_reports_all_n_at_once(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request(
        "p", "abc", SamplingParams(n=3, max_tokens=2), output_kind=RequestOutputKind.FINAL_ONLY
    )
    (out,) = drain(engine)
    assert out.request_id == "p" and out.finished
    assert [(c.index, c.text) for c in out.outputs] == [(0, "de"), (1, "de"), (2, "de")]


def test_children_get_seed_plus_index(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("p", "abc", SamplingParams(n=3, seed=7, temperature=0.9))
    reqs = engine.scheduler.requests
    assert [reqs[f"{i}_p"].sampling_params.seed for i in range(3)] == [7, 8, 9]
    assert all(reqs[f"{i}_p"].sampling_params.n == 1 for i in range(3))


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_aborting_the_parent_aborts_every_child(byte_model_dir: Path, fake_factory, kind) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("p", "abc", SamplingParams(n=3, max_tokens=50), output_kind=kind)
    engine.add_request("q", "xyz", SamplingParams(max_tokens=10))
    for _ in range(4):
        engine.step()
    aborted = engine.abort_request("p")
    assert {o.request_id for o in aborted} == {"p"}
    assert aborted[-1].finished and not any(o.finished for o in aborted[:-1])
    indexes = sorted(c.index for o in aborted for c in o.outputs)
    assert indexes == [0, 1, 2]
    assert all(c.finish_reason == "abort" for o in aborted for c in o.outputs)
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(aborted) == 1
    for i in range(3):
        assert engine.scheduler.kv.get_block_ids(f"{i}_p") == []
    assert engine.get_num_unfinished_requests() == 1
    assert engine.abort_request("p") == []
    rest = drain(engine)
    assert {o.request_id for o in rest} == {"q"}
    # The parent's id is free again.
    engine.add_request("p", "abc", SamplingParams(n=2, max_tokens=1))
    assert len(drain(engine)) == 2


def test_a_child_aborted_alone_still_lets_the_parent_finish(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request(
        "p", "abc", SamplingParams(n=2, max_tokens=3), output_kind=RequestOutputKind.FINAL_ONLY
    )
    assert engine.abort_request("1_p") == []  # FINAL_ONLY: the parent waits for child 0
    (out,) = drain(engine)
    assert out.request_id == "p" and out.finished
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(0, "length"), (1, "abort")]


def test_the_decision_trace_shows_each_child(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory, max_num_seqs=2)
    engine.scheduler.enable_trace()
    engine.add_request("p", "abc", SamplingParams(n=3, max_tokens=2))
    engine.step()
    trace = engine.engine_core.last_scheduled.trace
    reasons = {e.request_id: e.reason for e in trace.entries}
    assert reasons["0_p"] is Reason.SCHEDULED and reasons["1_p"] is Reason.SCHEDULED
    assert reasons["2_p"] is Reason.MAX_NUM_SEQS


def test_ids_in_use_are_refused_and_nothing_is_queued(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    engine.add_request("p", "abc", SamplingParams(n=2))
    with pytest.raises(RequestRejected, match="'p' is already in use"):
        engine.add_request("p", "abc", SamplingParams())
    with pytest.raises(RequestRejected, match="'1_p' is already in use"):
        engine.add_request("1_p", "abc", SamplingParams())
    engine.add_request("1_q", "abc", SamplingParams())
    with pytest.raises(RequestRejected, match="child request id '1_q' is already in use"):
        engine.add_request("q", "abc", SamplingParams(n=3))
    assert "0_q" not in engine.scheduler.requests
    assert engine.get_num_unfinished_requests() == 3


def test_a_rejected_child_takes_its_siblings_with_it(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    real = engine.engine_core.add_request
    calls = 0

    def third_fails(req):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RequestRejected(f"request {req.request_id!r}: refused")
        real(req)

    engine.engine_core.add_request = third_fails  # type: ignore[method-assign]
    with pytest.raises(RequestRejected, match=r"^request 'p': refused$"):
        engine.add_request("p", "abc", SamplingParams(n=3))
    engine.engine_core.add_request = real  # type: ignore[method-assign]
    assert not engine.has_unfinished_requests()
    assert not engine.engine_core.has_unfinished_requests()
    engine.add_request(
        "p", "abc", SamplingParams(n=3, max_tokens=1), output_kind=RequestOutputKind.FINAL_ONLY
    )
    (out,) = drain(engine)
    assert len(out.outputs) == 3


def test_n_cannot_combine_with_sessions_or_kv_transfer(byte_model_dir: Path, fake_factory) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    with pytest.raises(RequestRejected, match="n must be 1 with streaming input"):
        engine.add_request("s", "abc", SamplingParams(n=2), resumable=True)
    with pytest.raises(RequestRejected, match="kv_transfer_params cannot be combined with n=2"):
        engine.add_request("k", "abc", SamplingParams(n=2), kv_transfer_params={"do_remote_decode": True})
    assert not engine.has_unfinished_requests()
