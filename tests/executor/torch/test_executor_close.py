"""Closing a TorchExecutor that still holds rows of requests never reported finished; dropping one open."""

from __future__ import annotations

import gc
import weakref

from llmsched.core import Request, SamplingParams, SchedulerConfig
from llmsched.engine import EngineCore
from llmsched.executor.torch import TorchExecutor

# A 3-token prompt and 2 output tokens finish well within this many steps.
MAX_STEPS = 10


def test_close_after_rows_grew_during_a_step(tiny_models):
    kw = {"num_gpu_blocks": 16, "max_model_len": 64}
    ex = TorchExecutor(tiny_models["llama"].path, dtype="float32", max_num_seqs=1, **kw)
    for rid in ("a", "b"):
        # Each engine stops at the step its request finished, so the executor
        # never hears of it: "b" needs a second row, grown inside a step.
        engine = EngineCore(SchedulerConfig(block_size=ex.block_size, max_num_seqs=1, **kw), ex)
        engine.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
        for _ in range(MAX_STEPS):
            finished = engine.step().outputs.finished
            if finished:
                break
        assert [r.request_id for r in finished] == [rid], f"{rid!r} unfinished after {MAX_STEPS} steps"
        assert len(finished[0].output_token_ids) == 2
    assert set(ex.batch.states) == {"a", "b"} and ex.batch.block_table.shape[0] == 2
    ex.close()
    assert ex.batch.states == {} and not hasattr(ex, "kv_cache") and not hasattr(ex, "model")
    ex.close()  # a second close does nothing


def test_an_executor_dropped_without_close_is_collected_and_its_thread_ends(tiny_models):
    kw = {"num_gpu_blocks": 16, "max_model_len": 64}
    ex = TorchExecutor(tiny_models["qwen2"].path, dtype="float32", max_num_seqs=2, **kw)
    config = SchedulerConfig(block_size=ex.block_size, max_num_seqs=2, async_scheduling=True, **kw)
    engine = EngineCore(config, ex)
    engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    while engine.has_requests():
        engine.step()
    thread = ex._thread._thread
    ref = weakref.ref(ex)
    del engine, ex
    gc.collect()
    assert ref() is None
    thread.join(timeout=10)
    assert not thread.is_alive()
