"""Requests with logprobs, penalties or min_tokens speculate, and decode exactly as without speculation.

Each drafted row is processed as if the drafts before it had been
generated (spec.draft_rows), so greedy float32 outputs equal the
non-speculative ones token for token, and each kept token's logprobs are
those of its own position. Every test checks drafts were really verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmsched import SamplingParams
from llmsched.core import Request
from llmsched.executor.torch.input_batch import RequestState
from llmsched.executor.torch.penalties import apply_penalties, apply_penalties_with_drafts

from .test_spec_greedy import NGRAM, repeating_prompts, spec_engine


@dataclass
class Run:
    outputs: list[list[int]]
    logprobs: list[list[object]]
    drafts: int
    accepted: int


def drive(
    model: object,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    spec: dict | None,
    async_scheduling: bool,
) -> Run:
    """EngineCore over the float32 torch executor; collects each request's logprob entries too."""
    engine = spec_engine(model, spec=spec, async_scheduling=async_scheduling)
    reqs = [Request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs:
        engine.add_request(r)
    lps: dict[str, list[object]] = {r.request_id: [] for r in reqs}
    drafts = accepted = 0
    try:
        while engine.has_requests():
            es = engine.step()
            if es is None:
                continue
            mo = es.model_output
            verified = mo.num_drafts_verified or [0] * len(mo.sampled_token_ids)
            rows = zip(es.scheduler_output.scheduled, mo.sampled_token_ids, verified)
            for k, (req, toks, v) in enumerate(rows):
                drafts += v
                accepted += max(len(toks) - 1, 0) if v else 0
                entries = mo.logprobs[k] if mo.logprobs is not None else None
                if entries is not None:
                    lps[req.request_id].extend(entries)
    finally:
        engine.close()
    outs = [r.output_token_ids for r in reqs]
    # A step in flight when a request finished may have sampled past its end.
    return Run(outs, [lps[r.request_id][: len(o)] for r, o in zip(reqs, outs)], drafts, accepted)


def both(
    model: object,
    prompts: list[list[int]],
    params: list[SamplingParams],
    async_scheduling: bool,
    spec: dict = NGRAM,
) -> tuple[Run, Run]:
    """The same requests without and with speculation; drafts were verified and some kept."""
    off = drive(model, prompts, params, spec=None, async_scheduling=async_scheduling)
    on = drive(model, prompts, params, spec=spec, async_scheduling=async_scheduling)
    assert on.drafts > 0 and on.accepted > 0
    assert off.drafts == 0
    return off, on


def test_logprobs_of_accepted_and_bonus_tokens_equal_non_speculative(tiny_models, async_scheduling) -> None:
    model = tiny_models["llama"].path
    prompts = repeating_prompts(4, seed=11)
    params = [
        SamplingParams(max_tokens=16 + 2 * k, temperature=0.0, ignore_eos=True, logprobs=k % 3)
        for k in range(len(prompts))
    ]
    off, on = both(model, prompts, params, async_scheduling)
    assert on.outputs == off.outputs
    for a_list, b_list, out in zip(on.logprobs, off.logprobs, on.outputs):
        assert len(a_list) == len(b_list) == len(out)
        for a, b, t in zip(a_list, b_list, out):
            assert a.token_id == b.token_id == t
            assert a.rank == b.rank
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


def test_penalties_with_drafts_equal_non_speculative(tiny_models, async_scheduling) -> None:
    model = tiny_models["qwen3"].path
    prompts = repeating_prompts(4, seed=2)
    kinds = [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.4},
        {"presence_penalty": 0.6},
        {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.2},
    ]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, **kw) for kw in kinds]
    off, on = both(model, prompts, params, async_scheduling)
    assert on.outputs == off.outputs
    # The model drafting for itself proposes its unpenalised choice at every position.
    self_draft = {"model": str(model), "num_speculative_tokens": 3}
    on = drive(model, prompts, params, spec=self_draft, async_scheduling=async_scheduling)
    assert on.drafts > on.accepted > 0
    assert on.outputs == off.outputs
    plain = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * len(prompts)
    unpenalised = drive(model, prompts, plain, spec=None, async_scheduling=async_scheduling)
    # The penalties change what these requests generate (else equality would prove little).
    assert sum(a != b for a, b in zip(unpenalised.outputs, off.outputs)) >= 2


def test_min_tokens_masks_stops_at_drafted_positions(tiny_models, async_scheduling) -> None:
    model = tiny_models["mistral"].path
    prompts = repeating_prompts(4, seed=5)
    plain = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    long = drive(model, prompts, plain, spec=None, async_scheduling=async_scheduling).outputs
    # Stop on tokens of the repeating output; min_tokens carries past them.
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=out[2:5], min_tokens=10 + k)
        for k, out in enumerate(long)
    ]
    # The model drafting for itself proposes the stop tokens it prefers unmasked:
    # kept unless the drafted rows hold them back too.
    self_draft = {"model": str(model), "num_speculative_tokens": 3}
    off, on = both(model, prompts, params, async_scheduling, spec=self_draft)
    assert on.outputs == off.outputs
    for out, p in zip(on.outputs, params):
        assert len(out) > p.min_tokens
        assert not set(p.stop_token_ids) & set(out[: p.min_tokens])


def _state(params: SamplingParams, prompt: list[int], outputs: list[int]) -> RequestState:
    r = Request("r", prompt, params)
    for t in outputs:
        r.append_output_token(t)
    return RequestState(r, 0, 1, list(r.output_token_ids))


def test_penalty_rows_count_the_drafts_before_them() -> None:
    """Row i of a drafting request is penalised as the plain path would after drafts 0..i-1."""
    torch.manual_seed(0)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    drafts = [3, 5, 3]
    logits = torch.randn(4, 8)
    got = logits.clone()
    apply_penalties_with_drafts(got, 0, _state(params, [1, 2], [5]), drafts)
    for i in range(4):
        row = logits[i : i + 1].clone()
        apply_penalties(row, [0], [_state(params, [1, 2], [5, *drafts[:i]])])
        assert torch.allclose(got[i], row[0])
