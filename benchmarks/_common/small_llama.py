"""The small random-weight Llama several benchmarks run on the torch executor, and its helpers.

A Llama of hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1536,
vocab 32000 and untied embeddings, saved in bfloat16 with transformers'
random initialisation: e2e_cpu.py's ``small`` model, which the feature and
simulator benchmarks reuse so that their figures compare.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from llmsched.core import SamplingParams
from llmsched.sim.calibrate_executor import on_own_thread

T = TypeVar("T")

SMALL = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1536,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


@dataclass(slots=True)
class Workload:
    """Prompts and their output lengths."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        """Output tokens the requests asked for."""
        return sum(self.output_lens)


def make_workload(n: int, seed: int, vocab: int) -> Workload:
    """Seeded prompt lengths and output lengths in [64, 512], random token ids."""
    rng = random.Random(seed)
    lens = [(rng.randint(64, 512), rng.randint(64, 512)) for _ in range(n)]
    prompts = [[rng.randrange(vocab) for _ in range(p)] for p, _ in lens]
    return Workload(prompts, [o for _, o in lens])


def build_model(folder: Path, seed: int) -> None:
    """Save the small Llama with transformers' random initialisation, in bfloat16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.bfloat16)
    model.save_pretrained(folder)


def on_a_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on a thread that then exits, taking its OpenMP team with it.

    llmsched's torch executor runs the model on a thread of its own; libgomp
    cuts every team's spin-waiting short once it manages more threads than
    there are CPUs, so parallel torch work left behind on this thread would
    slow the executor's steps (see TorchExecutor).
    """
    return on_own_thread(fn, *args)


def greedy(n: int) -> SamplingParams:
    """Greedy, exactly n tokens."""
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
