"""The executor side of speculation: a step where nothing was proposed is the plain decode step."""

from __future__ import annotations

import torch

from llmsched.core import Request, SamplingParams, SchedulerOutput
from llmsched.core.speculative import SpeculativeConfig
from llmsched.executor.torch.input_batch import InputBatch, StepInputs, plan_step
from llmsched.executor.torch.spec.decoder import SpecDecoder

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def _batch() -> InputBatch:
    return InputBatch(
        block_size=4,
        max_blocks_per_request=8,
        max_num_seqs=4,
        device=torch.device("cpu"),
        decode_group_bytes=1 << 20,
        kv_row_bytes=64,
        keys_transposed=True,
        dtype=torch.float32,
    )


def _second_step(prompt: list[int], sampled: int) -> tuple[SpecDecoder, StepInputs, list[int] | None]:
    """Prefill ``prompt``, sample ``sampled``, propose; then the next step as async scheduling plans it."""
    spec = SpecDecoder(SpeculativeConfig.parse(NGRAM), max_model_len=32)
    b = _batch()
    r = Request("a", prompt, SamplingParams(max_tokens=8))
    n = len(prompt)
    r.num_computed_tokens = n
    so = SchedulerOutput(
        step=0, scheduled=[r], num_scheduled_tokens=[n], admitted=[r], admitted_block_ids=[[1, 2, 3]]
    )
    plan = plan_step(so, verifies_drafts=True)
    b.update(plan)
    spec.resolve(plan, b.states)
    b.prepare(plan)
    st = b.states["a"]
    st.generated.append(sampled)
    spec.propose([st], b)
    # Planned before that sample is applied: its token plus three placeholder drafts.
    r.num_computed_tokens = n + 4
    so2 = SchedulerOutput(step=1, scheduled=[r], num_scheduled_tokens=[4], spec_decode_tokens={"a": [-1] * 3})
    plan2 = plan_step(so2, verifies_drafts=True)
    b.update(plan2)
    spec.resolve(plan2, b.states)
    return spec, b.prepare(plan2), plan2.verify


def test_nothing_proposed_runs_the_plain_decode_step() -> None:
    _, step, verify = _second_step([10, 11, 12, 13, 14], 15)
    assert verify is None
    assert step.sample_drafts is None and step.sample_logit_rows is None
    # One row: the sampled token at its true position, as without speculation.
    assert step.positions.tolist() == [5]
    assert step.logits_indices.tolist() == [0]
    assert step.input_ids(torch.device("cpu")).tolist() == [15]


def test_proposed_drafts_are_verified_in_the_next_step() -> None:
    # Context 1 2 3 1 2 | 3: the 2-gram "2 3" occurred at the start, followed by 1 2 3.
    _, step, verify = _second_step([1, 2, 3, 1, 2], 3)
    assert verify == [3]
    assert step.sample_drafts == [[1, 2, 3]]
    assert step.positions.tolist() == [5, 6, 7, 8]
    assert step.logits_indices.tolist() == [0, 1, 2, 3]
    assert step.input_ids(torch.device("cpu")).tolist() == [3, 1, 2, 3]


def test_padded_admission_runs_its_last_token_only() -> None:
    """An admission with one token left, padded with 3 placeholders: one decode row, nothing verified."""
    spec = SpecDecoder(SpeculativeConfig.parse(NGRAM), max_model_len=32)
    b = _batch()
    r = Request("a", [10, 11, 12, 13, 14], SamplingParams(max_tokens=8))
    # A prefix-cache hit of 4 tokens, then the last prompt token and 3 placeholders.
    r.num_computed_tokens = 4 + 4
    so = SchedulerOutput(
        step=0,
        scheduled=[r],
        num_scheduled_tokens=[4],
        admitted=[r],
        admitted_block_ids=[[1, 2, 3]],
        spec_decode_tokens={"a": [-1] * 3},
    )
    plan = plan_step(so, verifies_drafts=True)
    b.update(plan)
    spec.resolve(plan, b.states)
    step = b.prepare(plan)
    assert plan.counts == [1] and plan.verify is None
    assert step.sample_drafts is None
    assert step.positions.tolist() == [4]
    # Position 4 is the first slot of block 2; no placeholder slot is written.
    assert step.attn.slot_mapping.tolist() == [8]
    assert step.logits_indices.tolist() == [0]
    assert step.input_ids(torch.device("cpu")).tolist() == [14]
