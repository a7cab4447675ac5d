"""The executor's thread: deferred steps are prepared there, after the steps queued before them."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from llmsched.core.output import ModelRunnerOutput
from llmsched.executor.torch import step_thread
from llmsched.executor.torch.step_thread import StepThread


class _FakeStep:
    """Just enough of StepInputs for the thread: its input tokens."""

    def __init__(self, token: int) -> None:
        self.token = token

    def input_ids(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.token])


def test_deferred_steps_are_prepared_on_the_thread_after_the_step_before() -> None:
    ran: list[int] = []
    names: list[str] = []

    def run(step: _FakeStep, ids: torch.Tensor) -> ModelRunnerOutput:
        ran.append(int(ids[0]))
        return ModelRunnerOutput(sampled_token_ids=[[int(ids[0])]])

    def prepare() -> _FakeStep:
        # Sees what the step before sampled, as speculative decoding needs.
        names.append(threading.current_thread().name)
        return _FakeStep(ran[-1] + 1)

    t = StepThread(run, torch.device("cpu"))
    try:
        first = t.submit(_FakeStep(10))  # type: ignore[arg-type]
        second = t.submit_deferred(prepare)  # type: ignore[arg-type]
        third = t.submit_deferred(prepare)  # type: ignore[arg-type]
        assert third.result(timeout=10).sampled_token_ids == [[12]]
        assert first.result().sampled_token_ids == [[10]]
        assert second.result().sampled_token_ids == [[11]]
        assert names == ["llmsched-executor"] * 2
    finally:
        t.close()


def test_a_failed_or_empty_preparation_settles_its_future_and_the_thread_goes_on() -> None:
    def run(step: _FakeStep, ids: torch.Tensor) -> ModelRunnerOutput:
        return ModelRunnerOutput(sampled_token_ids=[[int(ids[0])]])

    def fail() -> _FakeStep:
        raise KeyError("request 'x' is scheduled but was never admitted")

    empty = ModelRunnerOutput(sampled_token_ids=())
    t = StepThread(run, torch.device("cpu"))
    try:
        before = t.submit(_FakeStep(1))  # type: ignore[arg-type]
        bad = t.submit_deferred(fail)  # type: ignore[arg-type]
        nothing = t.submit_deferred(lambda: empty)
        after = t.submit_deferred(lambda: _FakeStep(2))  # type: ignore[arg-type,return-value]
        with pytest.raises(KeyError, match="never admitted"):
            bad.result(timeout=10)
        assert nothing.result(timeout=10) is empty
        assert before.result().sampled_token_ids == [[1]]
        assert after.result(timeout=10).sampled_token_ids == [[2]]
    finally:
        t.close()


class _Owner:
    """Something a queued call or preparation refers to (as the executor's bound methods do)."""

    def prepare(self) -> ModelRunnerOutput:
        return ModelRunnerOutput(sampled_token_ids=())

    def load(self) -> int:
        return 1


def test_the_thread_keeps_nothing_it_ran_while_it_waits() -> None:
    def run(step: _FakeStep, ids: torch.Tensor) -> ModelRunnerOutput:
        return ModelRunnerOutput(sampled_token_ids=[[int(ids[0])]])

    t = StepThread(run, torch.device("cpu"))
    try:
        owner = _Owner()
        ref = weakref.ref(owner)
        t.submit(_FakeStep(3)).result(timeout=10)  # type: ignore[arg-type]
        assert t.call(owner.load) == 1
        t.submit_deferred(owner.prepare).result(timeout=10)  # type: ignore[arg-type]
        del owner
        # Once the thread waits for more (a moment after the last future
        # settled), nothing refers to the owner any more: no cycle, no gc needed.
        for _ in range(1000):
            if ref() is None:
                break
            time.sleep(0.01)
        assert ref() is None
    finally:
        t.close()


def test_stop_ends_the_thread_after_what_is_queued_and_close_on_the_thread_does_not_wait() -> None:
    def run(step: _FakeStep, ids: torch.Tensor) -> ModelRunnerOutput:
        return ModelRunnerOutput(sampled_token_ids=[[int(ids[0])]])

    t = StepThread(run, torch.device("cpu"))
    queued = t.submit(_FakeStep(5))  # type: ignore[arg-type]
    t.stop()
    t._thread.join(timeout=10)
    assert not t._thread.is_alive()
    assert queued.result(timeout=0).sampled_token_ids == [[5]]
    assert t not in step_thread._running

    t = StepThread(run, torch.device("cpu"))
    # Its own close (a finalizer that ran on it) must neither join itself nor block.
    t.call(t.close)
    t._thread.join(timeout=10)
    assert not t._thread.is_alive()
