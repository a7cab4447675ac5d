"""A tiny random Bamba (Mamba2 + attention) on the torch executor equals transformers' greedy generate.

Prefills run whole, in block-aligned chunks, with prefix caching on (a
second pass of shared-prefix prompts resumes from cached Mamba states) and
off, and under a KV cache small enough to preempt; every path must give
transformers' tokens exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import BambaForCausalLM

from llmsched.core import Request, SchedulerConfig, SchedulerOutput
from llmsched.core.output import ModelRunnerOutput
from llmsched.engine import EngineCore
from llmsched.executor.torch import TorchExecutor
from support.tiny_bamba import VOCAB, build_tiny_bamba

from .conftest import greedy

MAX_TOKENS = 8
BLOCK = 4


@dataclass
class Tiny:
    """The saved folder and its transformers twin (float32)."""

    path: Path
    hf: BambaForCausalLM
    refs: dict

    def greedy(self, prompt: list[int]) -> list[int]:
        """transformers' greedy continuation (cached)."""
        key = tuple(prompt)
        if key not in self.refs:
            with torch.no_grad():
                out = self.hf.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                )
            self.refs[key] = out[0, len(prompt) :].tolist()
        return self.refs[key]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """The shared tiny Bamba (tests/support/tiny_bamba.py)."""
    folder = tmp_path_factory.mktemp("bamba")
    return Tiny(folder, build_tiny_bamba(folder), {})


def prompts(lengths: list[int], seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    """Random prompts of the given lengths after an optional shared prefix."""
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run(tiny: Tiny, passes: list[list[list[int]]], **kw: object) -> dict:
    """Each pass's prompts through one engine, a pass after the one before finished; outputs and stats."""
    batched = kw.pop("max_num_batched_tokens", 256)
    caching = kw.pop("enable_prefix_caching", True)
    blocks = kw.pop("num_gpu_blocks", 256)
    max_len = kw.pop("max_model_len", 128)
    ex = TorchExecutor(
        tiny.path,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=max_len,
        num_gpu_blocks=blocks,
        max_num_seqs=8,
        max_num_batched_tokens=batched,
    )
    assert ex.is_hybrid
    cfg = SchedulerConfig(
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        block_size=BLOCK,
        max_num_batched_tokens=batched,
        max_num_seqs=8,
        enable_prefix_caching=caching,
        mamba=True,
        debug=True,
        **kw,
    )
    engine = EngineCore(cfg, ex)
    stats = {"outputs": [], "hits": 0, "chunks": 0, "preempted": 0}
    try:
        for k, batch in enumerate(passes):
            reqs = [Request(f"{k}-{i}", p, greedy(MAX_TOKENS)) for i, p in enumerate(batch)]
            for r in reqs:
                engine.add_request(r)
            while engine.has_requests():
                es = engine.step()
                if es is None:
                    continue
                so = es.scheduler_output
                sampled = es.model_output.sampled_token_ids
                stats["hits"] += sum(1 for n in so.admitted_num_cached_tokens if n)
                stats["chunks"] += sum(
                    1 for i, n in enumerate(so.num_scheduled_tokens) if n > 1 and not sampled[i]
                )
                stats["preempted"] += len(so.preempted)
            stats["outputs"].append([r.output_token_ids for r in reqs])
    finally:
        ex.close()
    return stats


def expected(tiny: Tiny, passes: list[list[list[int]]]) -> list[list[list[int]]]:
    return [[tiny.greedy(p) for p in batch] for batch in passes]


def test_plain_prefill_and_decode(tiny: Tiny) -> None:
    passes = [prompts([5, 13, 21, 1], seed=1)]
    got = run(tiny, passes)
    assert got["outputs"] == expected(tiny, passes)
    # The outputs depend on the prompt (a broken mixer tends to give one sequence for all).
    assert len({tuple(o) for o in got["outputs"][0]}) > 1


def test_chunked_prefill_resumes_conv_and_ssm_states(tiny: Tiny, async_scheduling: bool) -> None:
    # A 12-token budget cuts the longer prompts into block-aligned chunks.
    passes = [prompts([30, 17, 9, 26], seed=2)]
    got = run(tiny, passes, max_num_batched_tokens=12, async_scheduling=async_scheduling)
    assert got["chunks"] > 0
    assert got["outputs"] == expected(tiny, passes)


def test_prefix_hits_resume_from_cached_states(tiny: Tiny, async_scheduling: bool) -> None:
    # The second pass repeats the shared prefix: its requests start from the
    # state cached at the last full block of the hit, not from zeros.
    shared = prompts([14], seed=3)[0]
    first = prompts([5, 8, 3], seed=4, prefix=shared)
    second = [*prompts([6, 9, 2, 7], seed=5, prefix=shared), first[1]]
    passes = [first, second]
    got = run(tiny, passes, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    assert got["hits"] >= len(second)
    assert got["outputs"] == expected(tiny, passes)


def test_prefix_caching_off(tiny: Tiny) -> None:
    shared = prompts([10], seed=6)[0]
    passes = [prompts([7, 11], seed=7, prefix=shared), prompts([3, 13], seed=8, prefix=shared)]
    got = run(tiny, passes, enable_prefix_caching=False, max_num_batched_tokens=10)
    assert got["hits"] == 0
    assert got["chunks"] > 0
    assert got["outputs"] == expected(tiny, passes)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_preemption_recomputes_states(tiny: Tiny, caching: bool, async_scheduling: bool) -> None:
    # 14 blocks of 4 tokens for six requests that each grow past 5 blocks,
    # each holding state blocks too: some must be preempted and recompute.
    passes = [prompts([12, 15, 9, 14, 11, 13], seed=9)]
    got = run(
        tiny,
        passes,
        num_gpu_blocks=14,
        max_model_len=32,
        enable_prefix_caching=caching,
        async_scheduling=async_scheduling,
    )
    assert got["preempted"] > 0
    assert got["outputs"] == expected(tiny, passes)


def test_llm_turns_on_the_mamba_state_group(tiny: Tiny) -> None:
    from llmsched import LLM, SamplingParams

    llm = LLM(
        model=str(tiny.path),
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=BLOCK,
        num_gpu_blocks_override=64,
        max_model_len=64,
    )
    try:
        assert llm.llm_engine.scheduler_config.mamba
        ps = prompts([11, 6], seed=10)
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    finally:
        llm.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == [tiny.greedy(p) for p in ps]


def test_hybrid_model_refuses_lora(tiny: Tiny) -> None:
    from llmsched.core.errors import ConfigError

    with pytest.raises(ConfigError, match="hybrid"):
        TorchExecutor(tiny.path, dtype="float32", num_gpu_blocks=16, max_model_len=32, enable_lora=True)


class PoisonHits:
    """Passes steps on to the executor after filling an admission's hit (KV and Mamba state) with noise."""

    def __init__(self, inner: TorchExecutor, rid: str, tell: bool) -> None:
        self.inner = inner
        self.rid = rid
        # False: poison, but keep recompute_from from the executor.
        self.tell = tell
        self.poisoned: list[int] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Poison the chosen admission's hit, then run the step."""
        for req, blocks, hit in zip(so.admitted, so.admitted_block_ids, so.admitted_num_cached_tokens):
            if req.request_id == self.rid and hit:
                assert so.mamba_state_ids is not None
                state = so.mamba_state_ids[req.request_id][0]
                g = torch.Generator().manual_seed(1)
                with torch.inference_mode():
                    states = self.inner.model.states  # type: ignore[attr-defined]
                    states.conv[:, state] = 5.0 * torch.randn(states.conv[:, state].shape, generator=g)
                    states.ssm[:, state] = 5.0 * torch.randn(states.ssm[:, state].shape, generator=g)
                    for layer in self.inner.kv_cache.blocks:
                        ids = blocks[: hit // BLOCK]
                        layer[:, :, ids] = 30.0 * torch.randn(layer[:, :, ids].shape, generator=g)
                self.poisoned.append(state)
                if self.tell:
                    so.recompute_from[req.request_id] = BLOCK
        return self.inner.execute(so)

    def close(self) -> None:
        """Close the wrapped executor."""
        self.inner.close()


@pytest.mark.parametrize("tell", [True, False], ids=["recompute", "no-recompute"])
def test_recompute_from_rebuilds_the_hit_state(tiny: Tiny, tell: bool) -> None:
    # A hit whose blocks were never computed (recompute_from): the chunk is
    # recomputed from position 0 and the hit's state block rewritten, so a
    # third request hitting the same state gets the right tokens too.
    shared = prompts([16], seed=11)[0]
    first, late, third = prompts([3, 5, 6], seed=12, prefix=shared)
    ex = TorchExecutor(tiny.path, dtype="float32", block_size=BLOCK, max_model_len=64, num_gpu_blocks=64)
    wrapper = PoisonHits(ex, "late", tell)
    cfg = SchedulerConfig(
        num_gpu_blocks=ex.num_gpu_blocks, max_model_len=64, block_size=BLOCK, mamba=True, debug=True
    )
    engine = EngineCore(cfg, wrapper)
    reqs = [
        Request(rid, p, greedy(MAX_TOKENS)) for rid, p in (("first", first), ("late", late), ("third", third))
    ]
    try:
        for r in reqs:
            engine.add_request(r)
            while engine.has_requests():
                engine.step()
    finally:
        wrapper.close()
    assert len(wrapper.poisoned) == 1
    outs = [r.output_token_ids for r in reqs]
    want = [tiny.greedy(p) for p in (first, late, third)]
    if tell:
        assert outs == want
    else:
        # The poison has teeth: without the recompute both later requests go wrong.
        assert outs[0] == want[0]
        assert outs[1] != want[1]
        assert outs[2] != want[2]


def test_config_counts_attention_layers_for_the_kv_cache(tiny: Tiny) -> None:
    from llmsched.executor.torch.config import ModelConfig

    cfg = ModelConfig.from_folder(tiny.path)
    spec = cfg.hybrid
    assert spec is not None
    assert cfg.architecture == "BambaForCausalLM"
    assert cfg.num_layers == 1
    assert spec.attn_layers == (1,)
    assert spec.mamba_layers == (0, 2, 3)
    assert (spec.num_heads, spec.head_dim, spec.num_groups, spec.state_size) == (8, 16, 2, 16)
    assert spec.conv_dim == 128 + 2 * 2 * 16
    # Bamba rotates half of each attention head.
    assert spec.rotary_dim == cfg.head_dim // 2
    assert spec.dt_max == float("inf")


def test_config_rejects_mamba_heads_that_do_not_split_the_width(tiny: Tiny) -> None:
    import json

    from llmsched.executor.torch.config import ModelConfig
    from llmsched.executor.torch.errors import ModelLoadError

    raw = json.loads((tiny.path / "config.json").read_text())
    raw["mamba_n_heads"] = 6
    raw["mamba_d_head"] = "auto"
    with pytest.raises(ModelLoadError, match="mamba_n_heads=6"):
        ModelConfig.from_dict(raw, tiny.path)


def test_a_cache_too_small_for_states_suggests_larger_blocks(tiny: Tiny) -> None:
    from llmsched.executor.torch.errors import KVCacheTooSmall

    with pytest.raises(KVCacheTooSmall, match=r"Mamba state .* a larger block_size"):
        TorchExecutor(tiny.path, dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=200_000)
