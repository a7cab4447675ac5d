"""Scheduling policies: waiting-queue order (FCFS, priority) and preemption victim selection."""

from __future__ import annotations

import itertools

import pytest

from llmsched.core.errors import ConfigError
from llmsched.core.policy import (
    FCFSPolicy,
    FCFSQueue,
    PriorityPolicy,
    PriorityQueue,
    WaitingQueue,
    make_policy,
)
from llmsched.core.request import Request


def req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    """A one-token request with the given id, priority and arrival time."""
    return Request(rid, [1], priority=priority, arrival_time=arrival)


def ids(queue: WaitingQueue) -> list[str]:
    """Request ids in the queue's iteration order."""
    return [r.request_id for r in queue]


def drain(queue: WaitingQueue) -> list[str]:
    """Pop everything; ids in pop order."""
    out = []
    while len(queue):
        out.append(queue.pop().request_id)
    return out


# ---- FCFS queue --------------------------------------------------------------


def test_fcfs_admits_in_arrival_order() -> None:
    q = FCFSQueue()
    for rid in "abcd":
        q.add(req(rid))
    assert len(q) == 4
    assert ids(q) == list("abcd")
    assert q.peek().request_id == "a"
    assert len(q) == 4
    assert drain(q) == list("abcd")
    assert len(q) == 0


def test_fcfs_ignores_priority_and_arrival_time() -> None:
    q = FCFSQueue()
    q.add(req("late", priority=5, arrival=9.0))
    q.add(req("early", priority=-5, arrival=1.0))
    assert drain(q) == ["late", "early"]


def test_fcfs_add_preempted_goes_to_front() -> None:
    q = FCFSQueue()
    q.add(req("a"))
    q.add(req("b"))
    q.add_preempted(req("p"))
    assert ids(q) == ["p", "a", "b"]
    assert q.peek().request_id == "p"


def test_fcfs_successive_preemptions_last_one_first() -> None:
    # The scheduler preempts the most recently admitted first, so the earliest
    # admitted victim, preempted last, ends up at the very front.
    q = FCFSQueue()
    q.add(req("w"))
    q.add_preempted(req("r3"))
    q.add_preempted(req("r2"))
    assert drain(q) == ["r2", "r3", "w"]


def test_fcfs_requeue_restores_original_order() -> None:
    q = FCFSQueue()
    for rid in "abcde":
        q.add(req(rid))
    popped = [q.pop(), q.pop(), q.pop()]
    q.requeue(popped[:2])
    assert ids(q) == ["a", "b", "d", "e"]
    q.requeue([popped[2]])
    assert ids(q) == ["c", "a", "b", "d", "e"]


def test_fcfs_requeue_all_restores_exact_order() -> None:
    q = FCFSQueue()
    for rid in "abc":
        q.add(req(rid))
    q.requeue([q.pop(), q.pop(), q.pop()])
    assert ids(q) == ["a", "b", "c"]


def test_fcfs_requeue_empty_is_noop() -> None:
    q = FCFSQueue()
    q.add(req("a"))
    q.requeue([])
    assert ids(q) == ["a"]


def test_fcfs_remove_one_and_many_keeps_order() -> None:
    q = FCFSQueue()
    rs = {rid: req(rid) for rid in "abcdef"}
    for r in rs.values():
        q.add(r)
    q.remove({rs["c"]})
    assert ids(q) == list("abdef")
    q.remove({rs["a"], rs["e"]})
    assert ids(q) == list("bdf")
    assert len(q) == 3
    assert drain(q) == list("bdf")


def test_fcfs_pop_and_peek_empty_raise() -> None:
    q = FCFSQueue()
    with pytest.raises(IndexError):
        q.pop()
    with pytest.raises(IndexError):
        q.peek()


# ---- priority queue ----------------------------------------------------------

PRIO_REQS = [
    ("p0_t2_b", 0, 2.0),
    ("p0_t2_a", 0, 2.0),
    ("p0_t5", 0, 5.0),
    ("p1_t0", 1, 0.0),
    ("pm1_t9", -1, 9.0),
    ("p1_t3", 1, 3.0),
]
PRIO_ORDER = ["pm1_t9", "p0_t2_a", "p0_t2_b", "p0_t5", "p1_t0", "p1_t3"]


@pytest.mark.parametrize("perm", list(itertools.permutations(range(len(PRIO_REQS))))[::37])
def test_priority_order_independent_of_insertion(perm: tuple[int, ...]) -> None:
    q = PriorityQueue()
    for i in perm:
        q.add(req(*PRIO_REQS[i]))
    assert q.peek().request_id == PRIO_ORDER[0]
    assert ids(q) == PRIO_ORDER
    assert len(q) == len(PRIO_ORDER)
    assert drain(q) == PRIO_ORDER


def test_priority_smaller_value_first_regardless_of_arrival() -> None:
    q = PriorityQueue()
    q.add(req("old_low", priority=2, arrival=0.0))
    q.add(req("new_high", priority=1, arrival=100.0))
    assert drain(q) == ["new_high", "old_low"]


def test_priority_tie_broken_by_arrival_then_id() -> None:
    q = PriorityQueue()
    q.add(req("z", priority=3, arrival=1.0))
    q.add(req("b", priority=3, arrival=2.0))
    q.add(req("a", priority=3, arrival=2.0))
    assert drain(q) == ["z", "a", "b"]


def test_priority_add_preempted_goes_by_key_not_front() -> None:
    q = PriorityQueue()
    q.add(req("a", priority=0, arrival=1.0))
    q.add(req("c", priority=2, arrival=3.0))
    q.add_preempted(req("p", priority=1, arrival=0.5))
    assert ids(q) == ["a", "p", "c"]


def test_priority_requeue_restores_order() -> None:
    q = PriorityQueue()
    for rid, prio, t in PRIO_REQS:
        q.add(req(rid, prio, t))
    before = ids(q)
    popped = [q.pop() for _ in range(3)]
    q.requeue(popped)
    assert ids(q) == before
    assert drain(q) == PRIO_ORDER


def test_priority_remove() -> None:
    q = PriorityQueue()
    rs = {rid: req(rid, prio, t) for rid, prio, t in PRIO_REQS}
    for r in rs.values():
        q.add(r)
    q.remove({rs["pm1_t9"], rs["p0_t5"]})
    assert len(q) == 4
    assert q.peek().request_id == "p0_t2_a"
    assert drain(q) == ["p0_t2_a", "p0_t2_b", "p1_t0", "p1_t3"]


def test_priority_iteration_does_not_consume() -> None:
    q = PriorityQueue()
    for rid, prio, t in PRIO_REQS:
        q.add(req(rid, prio, t))
    assert ids(q) == ids(q) == PRIO_ORDER
    assert len(q) == len(PRIO_REQS)


# ---- policies ----------------------------------------------------------------


def test_make_policy_by_name() -> None:
    fcfs = make_policy("fcfs")
    prio = make_policy("priority")
    assert isinstance(fcfs, FCFSPolicy)
    assert fcfs.name == "fcfs"
    assert isinstance(prio, PriorityPolicy)
    assert prio.name == "priority"
    assert isinstance(fcfs.make_queue(), FCFSQueue)
    assert isinstance(prio.make_queue(), PriorityQueue)


def test_make_policy_unknown_names_it() -> None:
    with pytest.raises(ConfigError) as exc_info:
        make_policy("lottery")
    assert "lottery" in str(exc_info.value)


def test_make_queue_returns_fresh_queues() -> None:
    for policy in (FCFSPolicy(), PriorityPolicy()):
        q1, q2 = policy.make_queue(), policy.make_queue()
        q1.add(req("a"))
        assert len(q1) == 1
        assert len(q2) == 0


def test_fcfs_victim_is_last_running() -> None:
    running = [req("a", priority=9, arrival=0.0), req("b", priority=-9, arrival=5.0), req("c", arrival=1.0)]
    assert FCFSPolicy().select_victim(running) is running[-1]
    assert FCFSPolicy().select_victim(running[:2]) is running[1]
    assert FCFSPolicy().select_victim(running[:1]) is running[0]


def test_priority_victim_largest_priority_value() -> None:
    running = [req("a", 0, 5.0), req("b", 3, 0.0), req("c", 1, 9.0)]
    assert PriorityPolicy().select_victim(running).request_id == "b"


def test_priority_victim_latest_arrival_among_equal_priority() -> None:
    running = [req("a", 2, 1.0), req("b", 2, 7.0), req("c", 2, 3.0), req("d", 0, 99.0)]
    assert PriorityPolicy().select_victim(running).request_id == "b"


def test_priority_victim_tie_broken_by_request_id() -> None:
    # Ties in (priority, arrival_time) fall to the id, the waiting queue's own
    # order, whatever the running order: the victim is the request that would
    # be admitted last.
    running = [req("a", 0, 0.0), req("x", 4, 2.0), req("y", 4, 2.0), req("z", 4, 2.0)]
    assert PriorityPolicy().select_victim(running).request_id == "z"
    assert PriorityPolicy().select_victim(running[::-1]).request_id == "z"


def test_priority_victim_is_the_last_the_queue_would_admit() -> None:
    running = [req("b", 1, 1.0), req("a", 1, 1.0), req("c", 0, 5.0)]
    queue = PriorityQueue()
    for r in running:
        queue.add(r)
    order = [queue.pop().request_id for _ in range(len(running))]
    assert PriorityPolicy().select_victim(running).request_id == order[-1] == "b"


def test_priority_victim_single_running() -> None:
    only = req("a", -3, 0.0)
    assert PriorityPolicy().select_victim([only]) is only
