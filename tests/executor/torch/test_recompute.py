"""SchedulerOutput.recompute_from: the executor rewrites prefix-cache hits whose KV was never computed.

Under the priority policy a chunk can be withdrawn after its blocks were
registered in the prefix cache; a request that later hits them is told to
compute from the first such block. The tests fill the stale blocks (or the
whole cache) with large random values, so that reading a slot the executor
did not write changes the greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from llmsched.core import Request, SchedulerConfig, SchedulerOutput
from llmsched.core.output import ModelRunnerOutput
from llmsched.engine import EngineCore
from llmsched.executor.torch import TorchExecutor

from .conftest import greedy, prompts_of

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def poison(ex: TorchExecutor, blocks: list[int] | None = None, seed: int = 0) -> None:
    """Overwrite the K/V of ``blocks`` (default: all but the null block) with large random values."""
    g = torch.Generator().manual_seed(seed)
    ids = blocks if blocks is not None else list(range(1, ex.num_gpu_blocks))
    with torch.inference_mode():
        for layer in ex.kv_cache.blocks:
            # Finite, so masked-out padding stays harmless (-inf + x is -inf).
            noise = 30.0 * torch.randn(layer[:, :, ids].shape, generator=g, dtype=layer.dtype)
            layer[:, :, ids] = noise


class RecomputeOverride:
    """Passes every step on to a TorchExecutor, poisoning chosen admissions' hits and saying so."""

    def __init__(self, inner: TorchExecutor, recompute_from: dict[str, int], *, tell: bool = True) -> None:
        self.inner = inner
        self.recompute_from = recompute_from
        # False: poison the blocks but keep the instruction from the executor.
        self.tell = tell
        # Block ids poisoned so far.
        self.poisoned: list[int] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Poison the chosen admissions' hit blocks past their recompute position, then run the step."""
        bs = self.inner.block_size
        for req, blocks, hit in zip(so.admitted, so.admitted_block_ids, so.admitted_num_cached_tokens):
            p = self.recompute_from.get(req.request_id)
            if p is not None and hit > p:
                stale = blocks[p // bs : hit // bs]
                poison(self.inner, stale, seed=len(self.poisoned))
                self.poisoned.extend(stale)
                if self.tell:
                    so.recompute_from[req.request_id] = p
        return self.inner.execute(so)

    def close(self) -> None:
        """Close the wrapped executor."""
        self.inner.close()


def engine_for(ex: object, num_gpu_blocks: int, max_model_len: int = 64, **config: object) -> EngineCore:
    """An EngineCore over ``ex`` with block size 4."""
    cfg = SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks, max_model_len=max_model_len, block_size=4, debug=True, **config
    )
    return EngineCore(cfg, ex)


def run_all(engine: EngineCore) -> list[SchedulerOutput]:
    """Step until idle; the scheduler outputs."""
    outs = []
    while engine.has_requests():
        outs.append(engine.step().scheduler_output)
    return outs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tail", [1, 7], ids=["one-token-chunk", "longer-chunk"])
def test_recompute_from_rewrites_poisoned_hit_blocks(tiny_models, family, tail):
    """A later request hits a finished one's blocks, which are then poisoned; recompute_from repairs them."""
    model = tiny_models[family]
    shared = prompts_of([20], seed=20)[0]
    first = shared + prompts_of([3], seed=21)[0]
    # A 20-token hit: with one more token the late request schedules a single
    # token, which recompute_from must turn into a prefill.
    late = shared + prompts_of([tail], seed=22)[0]
    ex = TorchExecutor(model.path, dtype="float32", num_gpu_blocks=64, max_model_len=64, block_size=4)
    wrapper = RecomputeOverride(ex, {"late": 8})
    engine = engine_for(wrapper, ex.num_gpu_blocks, max_num_batched_tokens=64, max_num_seqs=4)
    a = Request("first", first, greedy(6))
    engine.add_request(a)
    run_all(engine)
    b = Request("late", late, greedy(6))
    engine.add_request(b)
    outs = run_all(engine)
    assert outs[0].admitted_num_cached_tokens == [20]
    assert outs[0].num_scheduled_tokens == [tail]
    assert outs[0].recompute_from == {"late": 8}
    # Blocks 8-19 (three of them) held random values when the step ran.
    assert len(wrapper.poisoned) == 3
    assert a.output_token_ids == model.greedy(first, 6)
    assert b.output_token_ids == model.greedy(late, 6)


def test_poisoned_hit_blocks_without_recompute_change_the_output(tiny_models):
    """The check above has teeth: the same poisoned hit, not recomputed, breaks the greedy tokens."""
    model = tiny_models["llama"]
    shared = prompts_of([20], seed=20)[0]
    late = shared + prompts_of([7], seed=22)[0]
    ex = TorchExecutor(model.path, dtype="float32", num_gpu_blocks=64, max_model_len=64, block_size=4)
    wrapper = RecomputeOverride(ex, {"late": 8}, tell=False)
    engine = engine_for(wrapper, ex.num_gpu_blocks, max_num_batched_tokens=64, max_num_seqs=4)
    engine.add_request(Request("first", shared + prompts_of([3], seed=21)[0], greedy(6)))
    run_all(engine)
    b = Request("late", late, greedy(6))
    engine.add_request(b)
    outs = run_all(engine)
    assert outs[0].recompute_from == {}
    assert len(wrapper.poisoned) == 3
    assert b.output_token_ids != model.greedy(late, 6)


# A workload on which the scheduler itself emits recompute_from (the scenario
# of tests/core/test_scheduler_preemption.py): B (low priority) is scheduled
# for prompt tokens 24-32, then A preempts it within the same step, leaving
# blocks 24-28 registered but unwritten; B resumes with a 28-token hit and
# must compute from 24.
NATURAL = {
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "long_prefill_token_threshold": 8,
    "policy": "priority",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_scheduler_triggered_recompute_matches_transformers(tiny_models, family):
    model = tiny_models[family]
    prompt_b, prompt_a = prompts_of([36, 11], seed=23)
    ex = TorchExecutor(model.path, dtype="float32", num_gpu_blocks=11, max_model_len=40, block_size=4)
    poison(ex)
    engine = engine_for(ex, 11, max_model_len=40, **NATURAL)
    b = Request("B", prompt_b, greedy(4), priority=5, arrival_time=0.0)
    a = Request("A", prompt_a, greedy(1), priority=0, arrival_time=1.0)
    engine.add_request(b)
    outs = [engine.step().scheduler_output]
    engine.add_request(a)
    outs += run_all(engine)
    assert [r.request_id for so in outs for r in so.preempted] == ["B"]
    assert [so.recompute_from for so in outs if so.recompute_from] == [{"B": 24}]
    assert a.output_token_ids == model.greedy(prompt_a, 1)
    assert b.output_token_ids == model.greedy(prompt_b, 4)
