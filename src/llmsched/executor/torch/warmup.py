"""A dummy step at start-up, so that the first request does not pay the executor's first-time costs.

vLLM runs its model before it reports ready (the profile run, a dummy
sampler run, graph capture). Here two scratch requests go through the
executor's own step path: a prefill chunk, then a decode, with greedy rows
and a seeded random row that asks for logprobs, penalties and min_tokens,
so the attention kernels (the C ones on CPU, loaded and checked on first
use), the LM head and every sampling stage run once. Then the executor is
put back as it was: the scratch requests dropped from the input batch and
its free rows restored in order, the KV (and Mamba state) blocks they
wrote zeroed, the sampler's shared generator rewound. The scheduler never
sees them: its block pool, prefix cache and step counters are untouched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.core.request import Request
from llmsched.core.sampling_params import SamplingParams
from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.input_batch import InputBatch
from llmsched.executor.torch.kv_cache import KVCache, cdiv
from llmsched.executor.torch.sampler import Sampler
from llmsched.executor.torch.spec.decoder import SpecDecoder
from llmsched.executor.torch.step_thread import StepThread

log = logging.getLogger(__name__)

# The greedy request's prefill chunk (fewer where the limits below allow
# fewer): a typical first chunk, not the whole token budget, which on CPU
# would take seconds of start-up for no cost the first request still pays.
PREFILL_TOKENS = 128
# The sampled request's prompt.
SAMPLED_TOKENS = 8
_ID_PREFIX = "llmsched-warmup-"


@dataclass(frozen=True, slots=True)
class WarmUp:
    """What the start-up warm-up ran."""

    prompt_tokens: tuple[int, ...]
    steps: int
    seconds: float

    def note(self) -> str:
        """The start-up line."""
        return (
            f"warm-up: {self.steps} dummy steps (prefill of {'+'.join(map(str, self.prompt_tokens))} tokens, "
            f"then a decode) in {self.seconds:.2f} s, before serving"
        )


class WarmUpTarget(Protocol):
    """The executor state the warm-up reads, steps and puts back (``TorchExecutor``'s)."""

    device: torch.device
    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    _max_num_seqs: int
    is_hybrid: bool
    model_config: ModelConfig
    batch: InputBatch
    sampler: Sampler
    spec: SpecDecoder | None
    kv_cache: KVCache
    _thread: StepThread | None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait."""


def _prompt_lengths(ex: WarmUpTarget, max_num_batched_tokens: int) -> list[int]:
    """The scratch requests' prompt lengths (greedy first), within the executor's limits; [] if none fit."""
    bs = ex.block_size
    free_blocks = ex.num_gpu_blocks - 1  # block 0 is the null block
    # Each request also needs room for its decode token.
    longest = min(ex.max_model_len - 1, max_num_batched_tokens)
    lengths: list[int] = []
    wanted = [PREFILL_TOKENS, SAMPLED_TOKENS] if ex._max_num_seqs >= 2 else [SAMPLED_TOKENS]
    for want in reversed(wanted):
        budget = max_num_batched_tokens - sum(lengths)
        n = min(want, longest, budget, free_blocks * bs - 1)
        if n < 1:
            break
        lengths.insert(0, n)
        free_blocks -= cdiv(n + 1, bs)
    return lengths


def _requests(lengths: list[int], vocab: int) -> list[Request]:
    """Greedy requests, then (last) one sampled with every stage of the sampler."""
    sampled = SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        min_p=0.01,
        seed=0,
        logprobs=2,
        min_tokens=4,
        repetition_penalty=1.1,
        presence_penalty=0.1,
        frequency_penalty=0.1,
    )
    reqs = []
    for i, n in enumerate(lengths):
        params = sampled if i == len(lengths) - 1 else SamplingParams(temperature=0.0)
        prompt = [(7 * j + i + 1) % vocab for j in range(n)]
        reqs.append(Request(f"{_ID_PREFIX}{i}", prompt, params, eos_token_ids=(0,)))
    return reqs


def warm_up(ex: WarmUpTarget, max_num_batched_tokens: int) -> WarmUp | None:
    """Run the dummy prefill and decode on ``ex``, then undo their traces; None when nothing fits."""
    lengths = _prompt_lengths(ex, max_num_batched_tokens)
    if not lengths:
        log.info("warm-up skipped: the KV cache or the limits leave no room for a scratch request")
        return None
    t0 = time.perf_counter()
    reqs = _requests(lengths, ex.model_config.vocab_size)
    tables: list[list[int]] = []
    first = 1  # block 0 is the null block
    for n in lengths:
        k = cdiv(n + 1, ex.block_size)
        tables.append(list(range(first, first + k)))
        first += k
    free_rows = list(ex.batch._free_rows)
    generator = ex.sampler.generator.get_state()
    # Drafts need a proposer's own state: the warm-up runs the target model alone.
    spec, ex.spec = ex.spec, None
    try:
        _run_steps(ex, reqs, lengths, tables)
    finally:
        ex.execute(SchedulerOutput(step=2, finished_req_ids=[r.request_id for r in reqs]))
        ex.spec = spec
        ex.batch._free_rows = free_rows
        ex.sampler.generator.set_state(generator)
        ex._thread.call(_zero_blocks, ex, [b for t in tables for b in t])  # type: ignore[union-attr]
    return WarmUp(tuple(lengths), 2, time.perf_counter() - t0)


def _run_steps(ex: WarmUpTarget, reqs: list[Request], lengths: list[int], tables: list[list[int]]) -> None:
    """The scratch requests' prefill step, then their decode step, as a scheduler would send them."""
    # A hybrid model's state goes to (and comes back from) each request's first block.
    states = {r.request_id: t[0] for r, t in zip(reqs, tables)} if ex.is_hybrid else None
    for r, n in zip(reqs, lengths):
        r.num_computed_tokens = n
    ex.execute(
        SchedulerOutput(
            step=0,
            scheduled=list(reqs),
            num_scheduled_tokens=list(lengths),
            total_num_scheduled_tokens=sum(lengths),
            admitted=list(reqs),
            admitted_block_ids=tables,
            admitted_num_cached_tokens=[0] * len(reqs),
            admitted_resumed=[False] * len(reqs),
            mamba_state_ids=None if states is None else {rid: (-1, b) for rid, b in states.items()},
        )
    )
    # The decode's inputs are the tokens just sampled (the executor keeps its own copies).
    for r in reqs:
        r.append_output_token(ex.batch.states[r.request_id].generated[-1])
        r.num_computed_tokens += 1
    ex.execute(
        SchedulerOutput(
            step=1,
            scheduled=list(reqs),
            num_scheduled_tokens=[1] * len(reqs),
            total_num_scheduled_tokens=len(reqs),
            mamba_state_ids=None if states is None else {rid: (b, b) for rid, b in states.items()},
        )
    )


def _zero_blocks(ex: WarmUpTarget, block_ids: list[int]) -> None:
    """Zero what the scratch requests wrote: their KV blocks and, on a hybrid model, their state blocks."""
    idx = torch.tensor(block_ids, dtype=torch.int64, device=ex.device)
    with torch.inference_mode():
        for layer in ex.kv_cache.blocks:
            layer.index_fill_(2, idx, 0)
        states = getattr(ex, "mamba_states", None)
        if states is not None:
            states.conv.index_fill_(1, idx, 0)
            states.ssm.index_fill_(1, idx, 0)
