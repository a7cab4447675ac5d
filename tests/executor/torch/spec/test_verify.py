"""Draft verification: greedy keeps the matching prefix plus one; rejection sampling keeps the target."""

from __future__ import annotations

import torch

from llmsched.core.sampling_params import SamplingParams
from llmsched.executor.torch.sampler import Sampler
from llmsched.executor.torch.spec.verify import DraftVerifier, greedy_accept


def test_greedy_accept_keeps_the_matching_prefix_and_one_more() -> None:
    assert greedy_accept([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert greedy_accept([4, 5, 6, 7], [4, 9, 6]) == [4, 5]
    assert greedy_accept([4, 5, 6, 7], [1, 5, 6]) == [4]
    assert greedy_accept([3], []) == [3]


def test_greedy_rows_verified_in_a_mixed_batch() -> None:
    v = DraftVerifier(Sampler(torch.device("cpu"), 0))
    # Request 0 (greedy): 3 rows, argmax 2, 1, 0; request 1 (greedy): 1 row.
    logits = torch.tensor([[0, 1, 5.0], [0, 5, 1.0], [5, 0, 1.0], [1, 2, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    out = v.verify(logits, [[2, 0], []], [greedy, greedy], [0, 0])
    assert out == [[2, 1], [1]]


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_rejection_sampling_preserves_the_target_distribution() -> None:
    """Two drafted positions plus the bonus on a 5-token vocabulary: each position's marginal is the target's.

    The drafts are fixed (as prompt lookup's are), one likely and one
    unlikely under the target, so both the accept and the recover paths
    carry weight. Temperature and top_k apply before the test.
    """
    v = DraftVerifier(Sampler(torch.device("cpu"), 1234))
    logits = torch.tensor(
        [[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 0.3, 2.0, -0.5, 1.0], [1.0, 1.0, 0.0, 2.0, -3.0]]
    )
    params = SamplingParams(temperature=0.8, top_k=4)
    filtered = logits.clone()
    Sampler.apply_filters(filtered, [params] * 3)
    target = torch.softmax(filtered, -1).double()
    drafts = [0, 3]  # token 3 is outside the top 4 at position 1: always rejected there
    n = 12000
    first: list[int] = []
    second: list[int] = []
    third: list[int] = []
    # Many identical requests per call: one batched filter, as in a real step.
    outs = [
        o
        for _ in range(4)
        for o in v.verify(logits.repeat(n // 4, 1), [drafts] * (n // 4), [params] * (n // 4), [0] * (n // 4))
    ]
    for out in outs:
        first.append(out[0])
        if out[0] == drafts[0]:
            # Position 1 is reached (its token drawn) only after position 0 kept its draft.
            second.append(out[1])
            if len(out) == 3:
                third.append(out[2])
    assert (_frequencies(first, 5) - target[0]).abs().max() < 0.02
    assert (_frequencies(second, 5) - target[1]).abs().max() < 0.025
    assert 3 not in second and not third  # the unlikely draft never survives, so no bonus token
    assert len(second) / n == pytest_approx(float(target[0, drafts[0]]), 0.02)


def pytest_approx(x: float, tol: float):
    import pytest

    return pytest.approx(x, abs=tol)


def test_bonus_position_is_sampled_from_the_target() -> None:
    v = DraftVerifier(Sampler(torch.device("cpu"), 7))
    # Position 0 puts nearly all mass on the draft: the bonus row decides.
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0], [0.0, 1.0, 2.0, 0.5]])
    params = SamplingParams(temperature=1.0)
    bonus = v.verify(logits.repeat(8000, 1), [[0]] * 8000, [params] * 8000, [0] * 8000)
    assert all(len(b) == 2 and b[0] == 0 for b in bonus)
    assert (_frequencies([b[1] for b in bonus], 4) - torch.softmax(logits[1], -1)).abs().max() < 0.02


def test_seeded_requests_are_reproducible_and_match_the_plain_sampler_without_drafts() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=99)
    a = DraftVerifier(Sampler(torch.device("cpu"), 1)).verify(logits, [[3, 7, 11]], [params], [5])
    b = DraftVerifier(Sampler(torch.device("cpu"), 2)).verify(logits, [[3, 7, 11]], [params], [5])
    assert a == b
    # With no drafts the token is the plain sampler's for that output index.
    from llmsched.core.request import Request
    from llmsched.executor.torch.input_batch import RequestState

    st = RequestState(Request("r", [1, 2], params), 0, 0, [0] * 5)
    plain, _ = Sampler(torch.device("cpu"), 3).sample(logits[:1].clone(), [st])
    assert DraftVerifier(Sampler(torch.device("cpu"), 4)).verify(logits[:1], [[]], [params], [5]) == [plain]


def test_batched_verification_equals_each_request_alone() -> None:
    """Seeded requests keep the same tokens whichever requests share the batch (rows drawn per request)."""
    gen = torch.Generator().manual_seed(5)
    vocab = 40
    drafts = [[3, 1, 4], [], [9], [2, 6, 5, 8], [7, 7]]
    params = [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.6, seed=12, top_k=5),
        SamplingParams(temperature=1.0, seed=13, top_p=0.9),
        SamplingParams(temperature=1.0, seed=14),
    ]
    for trial in range(20):
        logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab, generator=gen) * 2
        # Make roughly half the drafts likely, so both the keep and the redraw paths run.
        row = 0
        for d in drafts:
            for i, t in enumerate(d):
                if (trial + i) % 2 == 0:
                    logits[row + i, t] += 8.0
            row += len(d) + 1
        firsts = [trial, 0, 3 * trial, 7, 1]
        together = DraftVerifier(Sampler(torch.device("cpu"), 0)).verify(logits, drafts, params, firsts)
        row = 0
        for j, d in enumerate(drafts):
            alone = DraftVerifier(Sampler(torch.device("cpu"), 1)).verify(
                logits[row : row + len(d) + 1], [d], [params[j]], [firsts[j]]
            )
            assert together[j] == alone[0], (trial, j)
            assert 1 <= len(together[j]) <= len(d) + 1 and together[j][:-1] == d[: len(together[j]) - 1]
            row += len(d) + 1
