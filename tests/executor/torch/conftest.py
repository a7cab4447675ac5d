"""Tiny random-weight Hugging Face models saved to disk, their greedy references, and an engine driver.

Every parameter is re-drawn (biases and norm weights included, which
transformers initialises to 0 and 1) so that a mistake in any of them shows
up in the tokens. Logit gaps are large enough that float32 rounding
differences between our kernels and transformers' cannot flip an argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from llmsched.core import Request, SamplingParams, SchedulerConfig
from llmsched.engine import EngineCore
from llmsched.executor.torch import TorchExecutor
from support.hf_reference import randomize

VOCAB = 320
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

FAMILIES = {
    # Llama 3 RoPE scaling with a short original context, so the rescaling
    # changes most frequencies.
    "llama": (
        LlamaForCausalLM,
        lambda: LlamaConfig(
            **COMMON,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
        ),
    ),
    # Qwen2: q/k/v biases, tied embeddings.
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**COMMON, tie_word_embeddings=True)),
    # Qwen3: per-head q/k RMSNorm, a head_dim unrelated to hidden / heads.
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**COMMON, head_dim=24)),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**COMMON, sliding_window=None)),
}


@dataclass
class TinyModel:
    """A saved random-weight model and its transformers twin (float32)."""

    family: str
    path: Path
    hf: torch.nn.Module
    _refs: dict = field(default_factory=dict)

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """transformers' greedy generate() for one prompt (cached)."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._refs:
            with torch.no_grad():
                out = self.hf.generate(
                    torch.tensor([list(prompt)]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                )
            self._refs[key] = out[0, len(prompt) :].tolist()
        return self._refs[key]


def build_tiny(family: str, folder: Path, seed: int = 0) -> TinyModel:
    """Create, randomise and save one family's tiny model."""
    cls, make_config = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(make_config()).eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return TinyModel(family, folder, model)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """One tiny model per family, built once per session."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {f: build_tiny(f, root / f, seed=i + 1) for i, f in enumerate(FAMILIES)}


def prompts_of(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Random prompts with the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@dataclass
class Step:
    """One engine step as the tests look at it."""

    # (request id, scheduled tokens, tokens sampled) per scheduled request.
    entries: list[tuple[str, int, int]]
    num_preempted: int


@dataclass
class Run:
    """What an engine run produced and how it got there."""

    outputs: list[list[int]]
    engine: EngineCore
    executor: TorchExecutor
    steps: list[Step] = field(default_factory=list)

    @property
    def num_chunked(self) -> int:
        """Scheduled chunks of more than one token that sampled nothing (partial prefills)."""
        return sum(1 for s in self.steps for _, n, k in s.entries if n > 1 and k == 0)

    @property
    def num_mixed_steps(self) -> int:
        """Steps that ran single-token decodes and multi-token chunks together."""
        return sum(
            1
            for s in self.steps
            if any(n == 1 for _, n, _ in s.entries) and any(n > 1 for _, n, _ in s.entries)
        )


def run_engine(
    model: Path | str,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    block_size: int = 4,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    num_gpu_blocks: int = 512,
    max_model_len: int = 128,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    executor: TorchExecutor | None = None,
    **executor_kwargs: object,
) -> Run:
    """Drive EngineCore + Scheduler + TorchExecutor (float32) until every prompt finishes.

    With ``async_scheduling`` the engine keeps a step in flight on the
    executor's thread while it plans the next one.
    """
    if executor is None:
        executor = TorchExecutor(
            model,
            dtype="float32",
            block_size=block_size,
            max_model_len=max_model_len,
            num_gpu_blocks=num_gpu_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            **executor_kwargs,
        )
    config = SchedulerConfig(
        num_gpu_blocks=executor.num_gpu_blocks,
        max_model_len=executor.max_model_len,
        block_size=executor.block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        async_scheduling=async_scheduling,
        debug=True,
    )
    engine = EngineCore(config, executor)
    plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    reqs = [Request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
    for r in reqs:
        engine.add_request(r)
    run = Run([], engine, executor)
    while engine.has_requests():
        es = engine.step()
        if es is None:
            continue
        so, mo = es.scheduler_output, es.model_output
        entries = [
            (r.request_id, n, len(mo.sampled_token_ids[i]))
            for i, (r, n) in enumerate(zip(so.scheduled, so.num_scheduled_tokens))
        ]
        run.steps.append(Step(entries, len(so.preempted)))
    run.outputs = [r.output_token_ids for r in reqs]
    return run


def bfloat16_outputs(
    model: Path | str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    block_size: int = 4,
    max_model_len: int = 96,
    max_num_batched_tokens: int = 256,
) -> list[list[int]]:
    """Greedy outputs of an engine on a bfloat16 TorchExecutor (closed afterwards)."""
    ex = TorchExecutor(
        model, dtype="bfloat16", num_gpu_blocks=256, max_model_len=max_model_len, block_size=block_size
    )
    try:
        return run_engine(
            model,
            prompts,
            greedy(max_tokens),
            executor=ex,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=8,
        ).outputs
    finally:
        ex.close()


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request: pytest.FixtureRequest) -> bool:
    """Run a test with the engine's scheduling in both modes."""
    return request.param


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy to exactly max_tokens."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
