"""Prompt-logprob requests skip reading the prefix cache (vLLM 0.33), still write it; the trace says why."""

from __future__ import annotations

import pytest

from llmsched.core import Request, SamplingParams
from llmsched.core.errors import InvalidSamplingParams
from llmsched.core.trace import PREFIX_CACHE_NOT_READ, Reason
from support.scheduling import make_sched, run_step

PROMPT = list(range(100, 140))  # 40 tokens: 9 full blocks of 4 a hit can cover


def params(**kw: object) -> SamplingParams:
    """Two greedy tokens, EOS ignored."""
    return SamplingParams(max_tokens=2, ignore_eos=True, **kw)  # type: ignore[arg-type]


def finish(s: object, rid: str) -> None:
    """Step until ``rid`` is done."""
    for _ in range(20):
        run_step(s)  # type: ignore[arg-type]
        if s.requests.get(rid) is None or s.requests[rid].is_finished:  # type: ignore[attr-defined]
            return
    raise AssertionError(f"{rid} did not finish")


def admitted_entry(s: object, req: Request) -> tuple[int, str]:
    """(prefix-cache hit, trace detail) of the step admitting ``req``."""
    s.add_request(req)  # type: ignore[attr-defined]
    out, _ = run_step(s)  # type: ignore[arg-type]
    entry = out.trace.reason_of(req.request_id)
    assert entry is not None and entry.reason is Reason.SCHEDULED
    return out.admitted_num_cached_tokens[out.admitted.index(req)], entry.detail


def test_prompt_logprobs_default_to_skipping_the_cache_read() -> None:
    assert params(prompt_logprobs=0).skip_reading_prefix_cache is True
    assert params(prompt_logprobs=True).prompt_logprobs == 1
    assert params().skip_reading_prefix_cache is False
    assert params(prompt_logprobs=2, skip_reading_prefix_cache=False).skip_reading_prefix_cache is False
    assert params(skip_reading_prefix_cache=True).skip_reading_prefix_cache is True


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs=21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs=-1"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs='2'"),
        ({"skip_reading_prefix_cache": "yes"}, "skip_reading_prefix_cache"),
    ],
)
def test_bad_values_are_refused_by_name(kw: dict, words: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=words):
        params(**kw)


def test_a_prompt_logprobs_request_gets_no_hit_and_the_trace_says_why() -> None:
    s = make_sched()
    s.enable_trace()
    s.add_request(Request("warm", PROMPT, params()))
    finish(s, "warm")
    hit, detail = admitted_entry(s, Request("plain", PROMPT, params()))
    assert hit == 36 and PREFIX_CACHE_NOT_READ not in detail
    finish(s, "plain")
    hit, detail = admitted_entry(s, Request("lp", PROMPT, params(prompt_logprobs=1)))
    assert hit == 0
    assert PREFIX_CACHE_NOT_READ in detail and "prefill 0-40 of 40" in detail


def test_it_still_writes_its_blocks_for_others() -> None:
    s = make_sched()
    s.add_request(Request("lp", PROMPT, params(prompt_logprobs=0)))
    finish(s, "lp")
    s.enable_trace()
    hit, _ = admitted_entry(s, Request("next", PROMPT, params()))
    assert hit == 36


def test_skip_reading_prefix_cache_false_reads_the_cache() -> None:
    s = make_sched()
    s.enable_trace()
    s.add_request(Request("warm", PROMPT, params()))
    finish(s, "warm")
    hit, detail = admitted_entry(
        s, Request("lp", PROMPT, params(prompt_logprobs=1, skip_reading_prefix_cache=False))
    )
    assert hit == 36 and PREFIX_CACHE_NOT_READ not in detail
