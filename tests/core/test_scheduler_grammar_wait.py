"""Requests whose output grammar is still compiling: skipped by admission, not blocking, then admitted."""

from __future__ import annotations

import pytest

from llmsched.core import Reason, RequestStatus
from support.scheduling import Pipeline, make_req, make_sched, ran, run_step, waiting_ids


class Flag:
    """A grammar handle whose readiness the test sets."""

    def __init__(self, ready: bool = False) -> None:
        self.ready = ready


def reasons(out: object) -> dict[str, Reason]:
    return {e.request_id: e.reason for e in out.trace.entries}  # type: ignore[attr-defined]


def test_a_constrained_request_starts_in_the_grammar_wait_status() -> None:
    assert make_req("A", 4, grammar=Flag()).status is RequestStatus.WAITING_FOR_GRAMMAR
    assert make_req("B", 4).status is RequestStatus.WAITING
    assert not RequestStatus.WAITING_FOR_GRAMMAR.finished


def test_compiling_request_is_skipped_and_those_behind_it_run_first() -> None:
    s = make_sched()
    s.enable_trace()
    flag = Flag()
    s.add_request(make_req("G", 8, grammar=flag))
    s.add_request(make_req("A", 8))
    s.add_request(make_req("B", 8))
    out, _ = run_step(s)
    assert list(ran(out)) == ["A", "B"]
    r = reasons(out)
    assert r["G"] is Reason.GRAMMAR_COMPILING
    assert "still compiling" in next(e.text() for e in out.trace.entries if e.request_id == "G")
    # Put back at the head, in its place.
    assert waiting_ids(s) == ["G"]
    assert s.requests["G"].status is RequestStatus.WAITING_FOR_GRAMMAR
    out, _ = run_step(s)
    assert list(ran(out)) == ["A", "B"]
    flag.ready = True
    out, _ = run_step(s)
    assert list(ran(out)) == ["A", "B", "G"]
    assert s.requests["G"].status is RequestStatus.RUNNING
    assert [r.request_id for r in out.admitted] == ["G"]


def test_a_ready_grammar_is_admitted_in_the_same_step_as_without_one() -> None:
    plain, constrained = make_sched(), make_sched()
    for s, grammar in ((plain, None), (constrained, Flag(True))):
        s.add_request(make_req("G", 30, grammar=grammar))
        s.add_request(make_req("A", 30))
    a, _ = run_step(plain)
    b, _ = run_step(constrained)
    assert ran(a) == ran(b) == {"G": 30, "A": 30}


def test_order_among_several_waiting_for_grammars_is_kept() -> None:
    s = make_sched()
    f1, f2 = Flag(), Flag()
    s.add_request(make_req("G1", 4, grammar=f1))
    s.add_request(make_req("G2", 4, grammar=f2))
    s.add_request(make_req("A", 4))
    run_step(s)
    assert waiting_ids(s) == ["G1", "G2"]
    f2.ready = True
    out, _ = run_step(s)
    assert [r.request_id for r in out.admitted] == ["G2"]
    assert waiting_ids(s) == ["G1"]


def test_aborting_a_request_that_waits_for_its_grammar_frees_nothing_and_drops_it() -> None:
    s = make_sched()
    s.add_request(make_req("G", 4, grammar=Flag()))
    run_step(s)
    free = s.kv.num_free_blocks
    [req] = s.finish_requests("G")
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert waiting_ids(s) == [] and s.kv.num_free_blocks == free
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("ready_after", [1, 3])
def test_async_mode_skips_then_admits(ready_after: int) -> None:
    s = make_sched(async_scheduling=True)
    flag = Flag()
    s.add_request(make_req("G", 8, max_tokens=4, grammar=flag))
    s.add_request(make_req("A", 8, max_tokens=4))
    p = Pipeline(s)
    admitted: list[str] = []
    for step in range(12):
        if step == ready_after:
            flag.ready = True
        out = p.schedule()
        admitted += [r.request_id for r in out.admitted]
        if len(p.in_flight) == 2:
            p.update()
    assert admitted == ["A", "G"]
