"""Why requests wait, read from the decision trace; the cache settings; KV residency through the loop."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.server.engine_loop import EngineLoop
from llmsched.server.engine_stats import UNTRACED, cache_config_labels, waiting_by_reason


def make_engine(model_dir: Path, fake_factory: Callable, **kwargs: object) -> LLMEngine:
    """An LLMEngine over the fake executor."""
    factory = fake_factory(num_gpu_blocks=64, max_model_len=512)
    args = EngineArgs(model=str(model_dir), max_num_batched_tokens=512, **kwargs)
    return LLMEngine(args, executor_factory=factory)


def add(engine: LLMEngine, rid: str, n: int = 8) -> None:
    """Queue one request of ``n`` prompt tokens."""
    engine.add_request(rid, {"prompt_token_ids": list(range(1, n + 1))}, SamplingParams(max_tokens=4))


def test_waiting_requests_are_counted_under_the_reasons_the_trace_gives(
    byte_model_dir: Path, fake_factory: Callable
) -> None:
    engine = make_engine(byte_model_dir, fake_factory, max_num_seqs=1)
    engine.scheduler.enable_trace()
    for i in range(3):
        add(engine, f"r{i}")
    engine.step()
    trace = engine.engine_core.last_scheduled.trace
    reasons = dict(waiting_by_reason(engine, trace))
    # The head of the queue met the cap; the one behind it was never looked at.
    assert reasons == {"max_num_seqs_reached": 1, "queued_behind": 1}
    # One queued after the step was planned has no entry yet: it waits behind the others.
    add(engine, "late")
    reasons = dict(waiting_by_reason(engine, trace))
    assert reasons == {"max_num_seqs_reached": 1, "queued_behind": 2}
    assert sum(reasons.values()) == len(engine.scheduler.waiting)


def test_without_a_trace_the_waiting_requests_are_reported_untraced(
    byte_model_dir: Path, fake_factory: Callable
) -> None:
    engine = make_engine(byte_model_dir, fake_factory, max_num_seqs=1)
    assert waiting_by_reason(engine, None) == ()
    add(engine, "a")
    add(engine, "b")
    assert waiting_by_reason(engine, None) == ((UNTRACED, 2),)


def test_cache_config_labels_name_the_engine_settings(byte_model_dir: Path, fake_factory: Callable) -> None:
    engine = make_engine(byte_model_dir, fake_factory, enable_prefix_caching=False)
    labels = cache_config_labels(engine)
    assert labels["enable_prefix_caching"] == "False"
    assert labels["num_gpu_blocks"] == "64"
    assert labels["block_size"] == str(engine.scheduler_config.block_size)


def test_the_loop_reports_step_tokens_once_and_ended_block_lives(
    byte_model_dir: Path, fake_factory: Callable
) -> None:
    engine = make_engine(byte_model_dir, fake_factory)
    sent: list[object] = []
    loop = EngineLoop(engine, sent.append, kv_metrics_sample=1.0)
    add(engine, "a", n=40)
    engine.step()
    first = loop.snapshot()
    assert first.step_tokens == engine.engine_core.last_scheduled.total_num_scheduled_tokens > 0
    assert loop.snapshot().step_tokens == 0
    while engine.has_unfinished_requests():
        engine.step()
    # A second request reuses the freed blocks: the first request's sampled lives end.
    add(engine, "b", n=200)
    engine.step()
    evictions = loop.snapshot().kv_evictions
    assert evictions
    assert all(lifetime >= idle >= 0 for lifetime, idle, _ in evictions)
    assert loop.snapshot().kv_evictions == ()
