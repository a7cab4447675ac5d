"""Batched LoRA equals transformers + PEFT with the adapter merged, token for token.

Three random adapters of ranks 4, 8 and 16 (different target modules, one
rsLoRA) and base-model requests share every step, on tiny random Llama and
Qwen3 models, with chunked prefill, prefix-cache hits (same adapter) next
to identical prompts under other adapters (which must not hit), and
preemption from a small KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from llmsched import LoRARequest
from llmsched.core import Request, SchedulerConfig
from llmsched.engine import EngineCore
from llmsched.executor.torch import TorchExecutor
from support.hf_reference import hf_greedy
from support.lora import make_adapter

from .conftest import TinyModel, greedy, prompts_of

pytest.importorskip("peft")

ADAPTERS = (
    # (rank, alpha, targets, rsLoRA)
    (4, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    (8, 8, ("q_proj", "v_proj", "down_proj"), False),
    (16, 32, ("k_proj", "o_proj", "gate_proj", "up_proj"), True),
)
MAX_TOKENS = 10


@dataclass
class Setup:
    """A tiny model, its adapters on disk and the merged transformers twin of each (index 0: base)."""

    model: TinyModel
    loras: list[LoRARequest]
    references: list[torch.nn.Module]


@pytest.fixture(scope="module")
def setups(tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Setup]:
    """Three adapters per family."""
    out = {}
    for family in ("llama", "qwen3"):
        tm = tiny_models[family]
        root = tmp_path_factory.mktemp(f"lora_{family}")
        loras, refs = [], [tm.hf]
        for k, (rank, alpha, targets, rs) in enumerate(ADAPTERS, start=1):
            folder = root / f"adapter{k}"
            refs.append(
                make_adapter(
                    tm.hf, folder, rank=rank, alpha=alpha, targets=targets, seed=10 + k, use_rslora=rs
                )
            )
            loras.append(LoRARequest(f"{family}-a{k}", k, str(folder)))
        out[family] = Setup(tm, loras, refs)
    return out


def workload() -> tuple[list[list[int]], list[int]]:
    """Prompts and the adapter index of each (0: base): shared prefixes within and across adapters."""
    shared = prompts_of([12], seed=5)[0]
    tails = prompts_of([9, 6, 11, 7, 5, 8, 10, 4], seed=6)
    prompts, adapters = [], []
    for j, tail in enumerate(tails):
        prompts.append(shared + tail)
        adapters.append(j % 4)
    # The same prompt under each adapter and the base model: outputs differ, prefix KV must not be shared.
    for a in range(4):
        prompts.append(shared + tails[0])
        adapters.append(a)
    return prompts, adapters


def run(setup: Setup, prompts: list[list[int]], adapters: list[int], async_scheduling: bool) -> dict:
    """Drive EngineCore + TorchExecutor with LoRA; outputs and what the steps did."""
    ex = TorchExecutor(
        setup.model.path,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        num_gpu_blocks=34,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
    )
    for lr in setup.loras:
        ex.add_lora(lr)
    cfg = SchedulerConfig(
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        block_size=4,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        max_loras=3,
        async_scheduling=async_scheduling,
        debug=True,
    )
    engine = EngineCore(cfg, ex)
    reqs = []
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        lr = setup.loras[a - 1] if a else None
        reqs.append(
            Request(
                str(i),
                p,
                greedy(MAX_TOKENS),
                lora_id=lr.lora_int_id if lr else 0,
                lora_name=lr.lora_name if lr else None,
            )
        )
        engine.add_request(reqs[-1])
    stats = {"preempted": 0, "chunks": 0, "hits": 0, "mixed": 0}
    while engine.has_requests():
        es = engine.step()
        if es is None:
            continue
        so = es.scheduler_output
        stats["preempted"] += len(so.preempted)
        sampled = es.model_output.sampled_token_ids
        stats["chunks"] += sum(1 for i, n in enumerate(so.num_scheduled_tokens) if n > 1 and not sampled[i])
        stats["hits"] += sum(1 for r, n in zip(so.admitted, so.admitted_num_cached_tokens) if n and r.lora_id)
        if len({r.lora_id for r in so.scheduled}) >= 3:
            stats["mixed"] += 1
    ex.close()
    stats["outputs"] = [r.output_token_ids for r in reqs]
    return stats


@pytest.mark.parametrize("products", ["stacked", "gathered"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_adapters_equal_merged_peft(
    setups: dict[str, Setup],
    family: str,
    products: str,
    async_scheduling: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if products == "gathered":
        from llmsched.executor.torch.lora import manager

        monkeypatch.setattr(manager, "STACKED_MAX_ROWS", 0)
    setup = setups[family]
    prompts, adapters = workload()
    got = run(setup, prompts, adapters, async_scheduling)
    want = [hf_greedy(setup.references[a], p, MAX_TOKENS) for p, a in zip(prompts, adapters)]
    assert got["outputs"] == want
    # The adapters matter: the same prompt gives four different continuations.
    assert len({tuple(o) for o in want[-4:]}) == 4
    assert got["preempted"] > 0
    assert got["chunks"] > 0
    assert got["hits"] > 0
    assert got["mixed"] > 0
