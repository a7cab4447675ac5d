"""Sampling: greedy, filters, the sampled distribution, seeds, min_tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

from llmsched.core import Request, SamplingParams
from llmsched.executor.torch.input_batch import RequestState
from llmsched.executor.torch.sampler import Sampler, TokenLogprobs, _inverse_cdf

CPU = torch.device("cpu")
LOGITS = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, -3.0])


def states(params: SamplingParams, n: int, prompt=(1, 2, 3), outputs: int = 0, eos=()) -> list[RequestState]:
    out = []
    for i in range(n):
        r = Request(f"r{i}", list(prompt), params, eos_token_ids=eos)
        for _ in range(outputs):
            r.append_output_token(0)
        out.append(RequestState(r, i, 1, r.output_token_ids))
    return out


def sample_many(params: SamplingParams, n: int = 20000, seed: int = 0) -> torch.Tensor:
    """Frequencies of each token over n rows of LOGITS."""
    s = Sampler(CPU, seed)
    toks, _ = s.sample(LOGITS.expand(n, -1).clone(), states(params, n))
    return torch.bincount(torch.tensor(toks), minlength=len(LOGITS)).float() / n


# Binomial standard deviation at n=20000 is at most 0.0036; 0.015 is over
# four of them, and the generator is seeded, so the test is deterministic.
TOL = 0.015


def test_greedy_rows_take_the_argmax():
    s = Sampler(CPU, 0)
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    toks, lps = s.sample(logits.clone(), states(SamplingParams(temperature=0.0), 5))
    assert toks == logits.argmax(-1).tolist()
    assert lps is None


def test_bfloat16_logits_greedy():
    s = Sampler(CPU, 0)
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)).bfloat16()
    toks, _ = s.sample(logits.clone(), states(SamplingParams(temperature=0.0), 3))
    assert toks == logits.float().argmax(-1).tolist()


def test_top_k_1_equals_greedy_on_the_random_path():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(3))
    s = Sampler(CPU, 0)
    st = states(SamplingParams(temperature=1.0, top_k=1), 64)
    assert s._random(logits.clone(), st).tolist() == logits.argmax(-1).tolist()
    # A very peaked temperature does the same.
    st = states(SamplingParams(temperature=1e-4), 64)
    assert s._random(logits.clone(), st).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_distribution(temperature):
    freq = sample_many(SamplingParams(temperature=temperature))
    expected = torch.softmax(LOGITS / temperature, -1)
    assert torch.allclose(freq, expected, atol=TOL), (freq, expected)


def test_top_p_distribution():
    # Sorted probabilities: 0.563 (2), 0.207 (1), 0.126 (4), 0.076 (0), ...
    # top_p 0.8: 0.563 + 0.207 = 0.770 < 0.8, so token 4 is also kept.
    freq = sample_many(SamplingParams(top_p=0.8))
    probs = torch.softmax(LOGITS, -1)
    kept = torch.zeros_like(probs)
    kept[[2, 1, 4]] = probs[[2, 1, 4]]
    assert torch.allclose(freq, kept / kept.sum(), atol=TOL)
    assert freq[[0, 3, 5]].sum() == 0


def test_top_p_with_temperature_and_top_k():
    freq = sample_many(SamplingParams(temperature=0.5, top_p=0.9, top_k=3))
    probs = torch.softmax(LOGITS / 0.5, -1)  # 0.830 (2), 0.112 (1), 0.041 (4)
    kept = torch.zeros_like(probs)
    kept[[2, 1]] = probs[[2, 1]]
    assert torch.allclose(freq, kept / kept.sum(), atol=TOL)


def test_min_p_distribution():
    # min_p 0.2 of the top probability 0.563: 0.113 keeps tokens 2, 1 and 4.
    freq = sample_many(SamplingParams(min_p=0.2))
    probs = torch.softmax(LOGITS, -1)
    kept = torch.zeros_like(probs)
    kept[[2, 1, 4]] = probs[[2, 1, 4]]
    assert torch.allclose(freq, kept / kept.sum(), atol=TOL)


def test_wide_nucleus_falls_back_to_a_full_sort():
    # 3000 equal tokens: the nucleus for top_p 0.5 spans 1500 > the 1024 candidates.
    logits = torch.zeros(4000, 3000)
    s = Sampler(CPU, 0)
    toks, _ = s.sample(logits, states(SamplingParams(top_p=0.5), 4000))
    # Which 1500 of the tied tokens survive depends on the sort; how many does not.
    assert 1000 < len(set(toks)) <= 1501


def test_inverse_cdf_edges_never_pick_a_filtered_token():
    logits = torch.tensor([[float("-inf"), 1.0, 2.0, float("-inf")]] * 3)
    u = torch.tensor([0.0, 1.0 - 2**-24, 0.5])
    picked = _inverse_cdf(logits, u).tolist()
    assert picked[0] == 1
    assert picked[1] == 2
    assert picked[2] in (1, 2)


def test_seeded_rows_ignore_batch_composition():
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(4))
    seeded = SamplingParams(seed=1234, temperature=1.0)
    alone = Sampler(CPU, 0).sample(logits.clone(), states(seeded, 1, outputs=5))[0][0]
    # Among unseeded neighbours, at another row, with another executor seed.
    mix = states(SamplingParams(temperature=1.0), 5) + states(seeded, 1, outputs=5)
    both = torch.cat([torch.randn(5, 200), logits])
    crowd = Sampler(CPU, 99).sample(both, mix)[0][5]
    assert alone == crowd
    # The draw depends on the output position: over many positions they differ.
    picks = {Sampler(CPU, 0).sample(logits.clone(), states(seeded, 1, outputs=k))[0][0] for k in range(30)}
    assert len(picks) > 5


def test_unseeded_rows_follow_the_executor_seed():
    logits = torch.zeros(50, 100)
    a = Sampler(CPU, 7).sample(logits.clone(), states(SamplingParams(), 50))[0]
    b = Sampler(CPU, 7).sample(logits.clone(), states(SamplingParams(), 50))[0]
    c = Sampler(CPU, 8).sample(logits.clone(), states(SamplingParams(), 50))[0]
    assert a == b
    assert a != c


def test_min_tokens_masks_stop_and_eos_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    s = Sampler(CPU, 0)
    # EOS 1 and stop token 2 are masked while fewer than 2 tokens exist.
    assert s.sample(logits.clone(), states(params, 1, outputs=0, eos=[1]))[0] == [3]
    assert s.sample(logits.clone(), states(params, 1, outputs=1, eos=[1]))[0] == [3]
    assert s.sample(logits.clone(), states(params, 1, outputs=2, eos=[1]))[0] == [1]
    # ignore_eos leaves EOS alone; the stop token is still held back.
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert s.sample(logits.clone(), states(ignore, 1, outputs=0, eos=[1]))[0] == [1]
    logits = torch.tensor([[0.0, 1.0, 4.0, 3.0]])
    assert s.sample(logits.clone(), states(ignore, 1, outputs=0, eos=[1]))[0] == [3]


def test_logprobs_shape_and_values():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    st = states(SamplingParams(temperature=0.0, logprobs=2), 1) + states(SamplingParams(temperature=0.0), 1)
    toks, lps = Sampler(CPU, 0).sample(logits.clone(), st)
    assert toks == [2, 0]
    assert lps[1] is None
    (entry,) = lps[0]
    assert isinstance(entry, TokenLogprobs)
    ref = torch.log_softmax(logits[0], -1)
    assert entry.token_id == 2 and entry.rank == 1
    assert entry.logprob == pytest.approx(ref[2].item())
    assert [t for t, _ in entry.top] == [2, 1]
    assert [v for _, v in entry.top] == pytest.approx([ref[2].item(), ref[1].item()])


def test_logprobs_rank_of_a_sampled_unlikely_token_and_zero_top():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    st = states(SamplingParams(temperature=1.0, top_k=1, logprobs=0), 1)
    # top_k=1 makes it greedy; logprobs are of the raw distribution.
    _, lps = Sampler(CPU, 0).sample(logits.clone(), st)
    (entry,) = lps[0]
    assert entry.top == []
    assert entry.rank == 1
    s = Sampler(CPU, 0)
    raw = torch.log_softmax(logits[0], -1)
    st = states(SamplingParams(temperature=0.0, logprobs=1, stop_token_ids=[2], min_tokens=3), 1)
    toks, lps = s.sample(logits.clone(), st)
    assert toks == [1]
    (entry,) = lps[0]
    assert entry.rank == 2
    assert entry.logprob == pytest.approx(raw[1].item())
    assert entry.top[0][0] == 2
