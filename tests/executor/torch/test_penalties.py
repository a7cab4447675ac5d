"""Repetition, frequency and presence penalties; stop-token masking."""

from __future__ import annotations

import torch

from llmsched.core import Request, SamplingParams
from llmsched.executor.torch.input_batch import RequestState
from llmsched.executor.torch.penalties import (
    apply_penalties,
    has_penalties,
    mask_stop_tokens,
    needs_stop_mask,
)


def state(params: SamplingParams, prompt: list[int], outputs: list[int]) -> RequestState:
    r = Request("r", prompt, params)
    for t in outputs:
        r.append_output_token(t)
    return RequestState(r, 0, 1, r.output_token_ids)


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    st = state(params, prompt=[0, 1], outputs=[2, 2, 4])
    assert has_penalties(st)
    apply_penalties(logits, [0], [st])
    expected = torch.tensor(
        [
            2.0 / 2.0,  # prompt token, positive: divided
            -2.0 * 2.0,  # prompt token, negative: multiplied
            1.0 / 2.0 - 0.5 * 2 - 0.25,  # output twice
            0.5,  # unseen
            -1.0 * 2.0 - 0.5 - 0.25,  # output once
            3.0,
        ]
    )
    assert torch.allclose(logits[0], expected)


def test_counts_follow_new_tokens_and_only_listed_rows_change():
    logits = torch.zeros(2, 5)
    params = SamplingParams(frequency_penalty=1.0)
    st = state(params, prompt=[3], outputs=[1])
    other = state(SamplingParams(), prompt=[3], outputs=[1])
    assert not has_penalties(other)
    apply_penalties(logits, [1], [other, st])
    assert logits[0].tolist() == [0.0] * 5
    assert logits[1].tolist() == [0.0, -1.0, 0.0, 0.0, 0.0]
    # Counts follow the executor's own samples (the Request may lag a step behind).
    st.generated.extend([1, 4])
    logits = torch.zeros(1, 5)
    apply_penalties(logits, [0], [st])
    assert logits[0].tolist() == [0.0, -2.0, 0.0, 0.0, -1.0]
    assert st.counted == 3


def test_stop_mask_rule_matches_check_stop():
    params = SamplingParams(min_tokens=2, stop_token_ids=[4])
    assert needs_stop_mask(state(params, [1], []))
    assert needs_stop_mask(state(params, [1], [0]))
    assert not needs_stop_mask(state(params, [1], [0, 0]))
    assert not needs_stop_mask(state(SamplingParams(min_tokens=2, ignore_eos=True), [1], []))
    logits = torch.zeros(1, 6)
    st = state(params, [1], [])
    mask_stop_tokens(logits, [0], [st])
    assert logits[0, 4] == float("-inf")
    assert logits[0, [0, 1, 2, 3, 5]].tolist() == [0.0] * 5


def test_out_of_vocabulary_ids_are_ignored():
    logits = torch.zeros(1, 4)
    st = state(SamplingParams(min_tokens=1, stop_token_ids=[9], presence_penalty=1.0), [7], [8])
    mask_stop_tokens(logits, [0], [st])
    apply_penalties(logits, [0], [st])
    assert logits.tolist() == [[0.0] * 4]
