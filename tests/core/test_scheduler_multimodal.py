"""The scheduler with encoder inputs: budget, trace reasons, references released, prefix keys."""

from __future__ import annotations

import pytest

from llmsched.core.config import SchedulerConfig
from llmsched.core.errors import RequestRejected
from llmsched.core.mm_item import MMItem
from llmsched.core.output import ModelRunnerOutput
from llmsched.core.request import Request
from llmsched.core.sampling_params import SamplingParams
from llmsched.core.scheduler import Scheduler
from llmsched.core.trace import Reason

PH = 31999


def prompt(n_before: int, n_img: int, n_after: int, base: int = 100) -> list[int]:
    return list(range(base, base + n_before)) + [PH] * n_img + list(range(base + 500, base + 500 + n_after))


def make(**kw) -> Scheduler:
    cfg = {
        "num_gpu_blocks": 200,
        "max_model_len": 1024,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 16,
        "debug": True,
    }
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def mm_req(
    rid: str, image: str, n_before: int = 40, n_img: int = 100, n_after: int = 20, base: int = 100, **kw
) -> Request:
    return Request(
        rid,
        prompt(n_before, n_img, n_after, base),
        SamplingParams(max_tokens=3, ignore_eos=True),
        mm_items=[MMItem(n_before, n_img, image)],
        **kw,
    )


def step(s: Scheduler):
    out = s.schedule()
    sampled = [[7] if r.num_computed_tokens >= r.num_tokens else [] for r in out.scheduled]
    s.update_from_output(out, ModelRunnerOutput(sampled))
    return out


def test_second_request_with_same_image_reuses_the_encoder_output():
    s = make(max_num_encoder_input_tokens=100, encoder_cache_size=300)
    s.add_request(mm_req("a", "img"))
    s.add_request(mm_req("b", "img", base=3000))
    out = s.schedule()
    # a encodes the image; b, scheduled in the same step (no prefix hit: other text), shares it.
    assert out.encoder_inputs == {"a": [0]}
    assert out.num_scheduled_tokens == [160, 96]
    assert s.encoder_scheduler.cache.num_references("img") == 2


def test_budget_holds_a_request_back_with_a_reason():
    s = make(max_num_encoder_input_tokens=100, encoder_cache_size=300)
    s.enable_trace()
    s.add_request(mm_req("a", "img-a", n_before=10))
    s.add_request(mm_req("b", "img-b", n_before=0))
    out = s.schedule()
    assert out.encoder_inputs == {"a": [0]}
    assert [r.request_id for r in out.scheduled] == ["a"]
    reasons = {e.request_id: e for e in out.trace.entries}
    assert reasons["b"].reason is Reason.ENCODER_HELD and "budget" in reasons["b"].detail


def test_references_drop_when_passed_and_on_preemption_and_finish():
    s = make(max_num_encoder_input_tokens=100, encoder_cache_size=300)
    s.add_request(mm_req("a", "img"))
    step(s)
    cache = s.encoder_scheduler.cache
    # The whole prompt ran in one step: the item is passed and unreferenced, but cached.
    assert cache.num_references("img") == 0 and "img" in cache
    while s.has_requests():
        step(s)
    assert cache.num_reclaimable == cache.size
    cache.check_invariants()


def test_preemption_releases_encoder_references():
    s = make(max_num_encoder_input_tokens=100, encoder_cache_size=300, max_num_batched_tokens=64)
    s.add_request(mm_req("a", "img"))
    step(s)  # 40 text tokens + 24 of the image: the reference is held
    cache = s.encoder_scheduler.cache
    assert cache.num_references("img") == 1
    s._preempt(s.running.pop())
    assert cache.num_references("img") == 0


def test_prefix_cache_keys_carry_the_image():
    s = make(max_num_encoder_input_tokens=100, encoder_cache_size=300)
    s.add_request(mm_req("a", "img-1"))
    while s.has_requests():
        step(s)
    s.add_request(mm_req("b", "img-2"))
    s.add_request(mm_req("c", "img-1", arrival_time=1e9))
    out = s.schedule()
    hits = dict(zip([r.request_id for r in out.admitted], out.admitted_num_cached_tokens))
    # Same tokens: b (another image) hits only the text blocks before it; c all full blocks.
    assert hits["b"] == 32 and hits["c"] == 144


def test_item_larger_than_the_budget_is_rejected():
    s = make(max_num_encoder_input_tokens=64)
    with pytest.raises(RequestRejected, match="encoder budget"):
        s.add_request(mm_req("a", "img", n_img=100))
    assert not s.has_requests()


def test_unsplittable_item_larger_than_the_token_budget_is_rejected():
    """vLLM refuses such a config at startup; a request that could never run must not hang."""
    s = make(
        max_num_batched_tokens=64,
        disable_chunked_mm_input=True,
        max_num_encoder_input_tokens=200,
        encoder_cache_size=200,
    )
    with pytest.raises(RequestRejected, match="disable_chunked_mm_input"):
        s.add_request(mm_req("a", "img", n_img=100))


def test_text_only_scheduler_has_no_encoder_side():
    s = make()
    s.add_request(Request("t", [1, 2, 3], SamplingParams(max_tokens=2)))
    out = s.schedule()
    assert out.encoder_inputs is None and s._enc is None
