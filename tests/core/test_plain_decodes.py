"""Plain decode steps: advance_decode_steps leaves exactly the state that schedule() + update would."""

from __future__ import annotations

import random

import pytest

from llmsched.core import SamplingParams, Scheduler
from llmsched.core.plain_decodes import PlainDecodes
from support.decode_state import feed, snapshot
from support.scheduling import make_req, make_sched, run_step


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"enable_prefix_caching": False},
        {"num_gpu_blocks": 40, "max_num_seqs": 6, "plain_steps_expected": False},
        {"block_size": 16, "num_gpu_blocks": 60, "max_model_len": 96},
        {"max_num_batched_tokens": 8, "max_num_seqs": 8, "plain_steps_expected": False},
    ],
)
@pytest.mark.parametrize("mode", ["plain", "unread", "through_finish"])
def test_plain_decode_steps_equal_scheduled_steps(seed, overrides, mode):
    unread = mode != "plain"
    through = mode == "through_finish"
    overrides = dict(overrides)
    expected = overrides.pop("plain_steps_expected", True)
    rng = random.Random(seed)
    stepped, skipped = make_sched(**overrides), make_sched(**overrides)
    shared = [900_000 + j for j in range(64)]
    num_plain = num_finishing = 0
    for _ in range(60):
        if rng.random() < 0.3:
            feed([stepped, skipped], random.Random(rng.random()), rng.randrange(1, 4), shared)
        limit = rng.randrange(1, 30)
        had_finished = bool(skipped._finished_ids)
        k = PlainDecodes(skipped).plain_decode_steps(
            7, limit, finished_ids_unread=unread, through_finish=through
        )
        assert k <= limit
        if had_finished and not unread:
            assert k == 0
        if k:
            for j in range(k):
                out, res = run_step(stepped)
                # A plain step: everyone runs one token, nothing is admitted, preempted or finished
                # (but the last one of a run through a finish).
                assert out.num_scheduled_tokens == [1] * len(out.scheduled) and not out.admitted
                assert not out.preempted and (not res.finished or (through and j == k - 1))
            finished = PlainDecodes(skipped).advance_decode_steps(k, 7)
            assert [r.request_id for r in finished] == [r.request_id for r in res.finished]
            assert all(r.status == res.finished[i].status for i, r in enumerate(finished))
            num_finishing += bool(finished)
            num_plain += k
        else:
            run_step(stepped)
            run_step(skipped)
        assert snapshot(skipped) == snapshot(stepped)
    # Under KV or budget pressure a queue usually waits, and no step is plain.
    assert num_plain or not expected
    # Only a run through a finish finishes anything, and such runs do.
    assert not num_finishing or through
    assert num_finishing or not (through and expected)


def test_no_plain_steps_while_anything_else_may_happen():
    s = make_sched()
    s.add_request(make_req("a", 10, max_tokens=5))
    assert PlainDecodes(s).plain_decode_steps(7, 100) == 0  # waiting
    run_step(s)
    assert (
        PlainDecodes(s).plain_decode_steps(7, 100) == 3
    )  # the 5th token finishes it: 4 samples to go, the last not plain
    s.add_request(make_req("b", 10, max_tokens=5))
    assert PlainDecodes(s).plain_decode_steps(7, 100) == 0
    run_step(s)
    run_step(s)
    stop = make_sched()
    stop.add_request(make_req("c", 10, params=SamplingParams(max_tokens=9, stop_token_ids=[7])))
    run_step(stop, token=8)
    assert PlainDecodes(stop).plain_decode_steps(7, 100) == 0  # would sample its stop token
    assert PlainDecodes(stop).plain_decode_steps(8, 100) == 7
    # A finish is reported in the next batch: not plain, unless nobody reads it.
    both = make_sched()
    both.add_request(make_req("e", 10, max_tokens=2))
    both.add_request(make_req("f", 10, max_tokens=8))
    run_step(both)
    run_step(both)
    assert both._finished_ids == ["e"]
    assert PlainDecodes(both).plain_decode_steps(7, 100) == 0
    assert PlainDecodes(both).plain_decode_steps(7, 100, finished_ids_unread=True) == 5
    PlainDecodes(both).advance_decode_steps(5, 7)
    assert both._finished_ids == []
    async_sched = make_sched(async_scheduling=True)
    async_sched.add_request(make_req("d", 10))
    run_step(async_sched)
    assert PlainDecodes(async_sched).plain_decode_steps(7, 100) == 0


def test_the_scheduler_class_holds_no_shortcut():
    shortcuts = [name for name in vars(PlainDecodes) if not name.startswith("__")]
    assert "plain_decode_steps" in shortcuts and "async_cohort_update" in shortcuts
    assert not [name for name in shortcuts if hasattr(Scheduler, name)]
