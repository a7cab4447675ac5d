"""Request token state and check_stop: EOS, stop tokens, length limits, min_tokens, and their order."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from llmsched.core.request import Request, RequestStatus, check_stop
from llmsched.core.sampling_params import SamplingParams

EOS = 2
PROMPT = [11, 12, 13, 14, 15]


def make_request(
    prompt: Iterable[int] = PROMPT,
    eos: Iterable[int] = (EOS,),
    **params: object,
) -> Request:
    """A request over ``prompt`` with the given sampling params and EOS ids."""
    return Request("r", list(prompt), SamplingParams(**params), eos_token_ids=eos, arrival_time=0.0)


def feed(request: Request, tokens: Iterable[int]) -> int | None:
    """Append tokens one by one, checking stop after each; return the 1-based output index that stopped."""
    for token in tokens:
        request.append_output_token(token)
        if check_stop(request, token):
            return request.num_output_tokens
    return None


# ---- token state -------------------------------------------------------------


def test_new_request_state() -> None:
    req = make_request(max_tokens=7)
    assert req.request_id == "r"
    assert req.prompt_token_ids == PROMPT
    assert req.token_ids == PROMPT
    assert req.num_prompt_tokens == 5
    assert req.num_tokens == 5
    assert req.num_computed_tokens == 0
    assert req.output_token_ids == []
    assert req.num_output_tokens == 0
    assert req.status is RequestStatus.WAITING
    assert req.finish_reason is None
    assert not req.is_finished
    assert req.stop_reason is None
    assert req.stop_length == 5 + 7


def test_prompt_is_copied() -> None:
    prompt = [1, 2, 3]
    req = make_request(prompt)
    prompt.append(4)
    assert req.prompt_token_ids == [1, 2, 3]
    assert req.num_tokens == 3


def test_append_output_tokens() -> None:
    req = make_request()
    req.append_output_token(100)
    req.append_output_token(101)
    assert req.num_tokens == 7
    assert req.num_prompt_tokens == 5
    assert req.num_output_tokens == 2
    assert req.output_token_ids == [100, 101]
    assert req.token_ids == [*PROMPT, 100, 101]
    assert req.prompt_token_ids == PROMPT


def test_output_token_ids_is_a_copy() -> None:
    req = make_request()
    req.append_output_token(100)
    req.output_token_ids.append(999)
    assert req.output_token_ids == [100]
    assert req.num_tokens == 6


def test_default_sampling_params() -> None:
    req = Request("d", [1, 2])
    assert req.max_tokens == SamplingParams().max_tokens
    assert req.stop_length == 2 + SamplingParams().max_tokens


def test_arrival_time_defaults_to_now_and_is_kept_when_given() -> None:
    a = Request("a", [1])
    b = Request("b", [1])
    assert b.arrival_time >= a.arrival_time
    assert Request("c", [1], arrival_time=3.5).arrival_time == 3.5


def test_lora_name_from_id() -> None:
    assert Request("a", [1], lora_id=3).lora_name == "3"
    assert Request("b", [1], lora_id=3, lora_name="sql").lora_name == "sql"
    assert Request("c", [1]).lora_name is None


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RequestStatus.WAITING, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
        (RequestStatus.FINISHED_ERROR, "error"),
    ],
)
def test_finish_reason_and_finished_per_status(status: RequestStatus, reason: str | None) -> None:
    req = make_request()
    req.status = status
    assert req.finish_reason == reason
    assert req.is_finished is (reason is not None)
    assert status.finished is (reason is not None)


# ---- check_stop: single rules -----------------------------------------------


def test_ordinary_token_does_not_stop() -> None:
    req = make_request(max_tokens=5)
    assert feed(req, [50, 51, 52]) is None
    assert req.status is RequestStatus.WAITING
    assert req.finish_reason is None


def test_eos_stops() -> None:
    req = make_request(max_tokens=10)
    assert feed(req, [50, EOS, 51]) == 2
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.finish_reason == "stop"
    assert req.stop_reason is None
    assert req.output_token_ids == [50, EOS]


def test_any_of_several_eos_ids_stops() -> None:
    req = make_request(eos=(2, 3), max_tokens=10)
    assert feed(req, [50, 3]) == 2
    assert req.finish_reason == "stop"
    assert req.stop_reason is None


def test_no_eos_ids_means_eos_is_ordinary() -> None:
    req = make_request(eos=(), max_tokens=3)
    assert feed(req, [EOS, EOS, EOS]) == 3
    assert req.finish_reason == "length"


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = make_request(ignore_eos=True, max_tokens=4)
    assert feed(req, [EOS, EOS, EOS, EOS, EOS]) == 4
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.finish_reason == "length"


def test_stop_token_sets_stop_reason() -> None:
    req = make_request(stop_token_ids=[77, 78], max_tokens=10)
    assert feed(req, [50, 78]) == 2
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.finish_reason == "stop"
    assert req.stop_reason == 78


def test_stop_token_still_stops_with_ignore_eos() -> None:
    req = make_request(stop_token_ids=[77], ignore_eos=True, max_tokens=10)
    assert feed(req, [EOS, 77]) == 2
    assert req.stop_reason == 77


def test_eos_listed_as_stop_token_with_ignore_eos_stops_as_stop_token() -> None:
    req = make_request(stop_token_ids=[EOS], ignore_eos=True, max_tokens=10)
    assert feed(req, [50, EOS]) == 2
    assert req.finish_reason == "stop"
    assert req.stop_reason == EOS


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_caps_length(max_tokens: int) -> None:
    req = make_request(max_tokens=max_tokens)
    assert feed(req, range(100, 120)) == max_tokens
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.finish_reason == "length"
    assert req.stop_reason is None


def test_max_model_len_caps_length_through_stop_length() -> None:
    req = make_request(max_tokens=10)
    # What the scheduler does on add_request with max_model_len = 8.
    req.stop_length = min(req.num_prompt_tokens + req.max_tokens, 8)
    assert feed(req, range(100, 120)) == 3
    assert req.num_tokens == 8
    assert req.finish_reason == "length"


# ---- min_tokens -------------------------------------------------------------


@pytest.mark.parametrize("min_tokens", [1, 2, 4])
def test_min_tokens_holds_back_eos(min_tokens: int) -> None:
    req = make_request(min_tokens=min_tokens, max_tokens=10)
    # A stop token can first be sampled as output number min_tokens + 1.
    assert feed(req, [EOS] * min_tokens) is None
    assert req.status is RequestStatus.WAITING
    assert feed(req, [EOS]) == min_tokens + 1
    assert req.finish_reason == "stop"


@pytest.mark.parametrize("min_tokens", [1, 3])
def test_min_tokens_holds_back_stop_tokens(min_tokens: int) -> None:
    req = make_request(min_tokens=min_tokens, stop_token_ids=[77], max_tokens=10)
    assert feed(req, [77] * min_tokens) is None
    assert req.stop_reason is None
    assert feed(req, [77]) == min_tokens + 1
    assert req.stop_reason == 77


def test_min_tokens_does_not_hold_back_max_tokens() -> None:
    req = make_request(min_tokens=3, max_tokens=3)
    assert feed(req, [EOS, EOS, EOS]) == 3
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_does_not_hold_back_max_model_len() -> None:
    req = make_request(min_tokens=5, max_tokens=10)
    req.stop_length = req.num_prompt_tokens + 2
    assert feed(req, [100, 101, 102]) == 2
    assert req.finish_reason == "length"


def test_min_tokens_counts_only_output_tokens() -> None:
    # A long prompt does not count towards min_tokens.
    req = make_request(prompt=range(1000, 1050), min_tokens=2, max_tokens=10)
    assert feed(req, [EOS, EOS]) is None
    assert feed(req, [EOS]) == 3


# ---- rule order -------------------------------------------------------------


def test_eos_beats_max_tokens_on_last_token() -> None:
    req = make_request(max_tokens=3)
    assert feed(req, [50, 51, EOS]) == 3
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.finish_reason == "stop"


def test_eos_beats_max_tokens_on_first_token() -> None:
    req = make_request(max_tokens=1)
    assert feed(req, [EOS]) == 1
    assert req.finish_reason == "stop"


def test_stop_token_beats_max_tokens() -> None:
    req = make_request(stop_token_ids=[77], max_tokens=2)
    assert feed(req, [50, 77]) == 2
    assert req.finish_reason == "stop"
    assert req.stop_reason == 77


def test_eos_beats_max_model_len() -> None:
    req = make_request(max_tokens=10)
    req.stop_length = req.num_prompt_tokens + 2
    assert feed(req, [50, EOS]) == 2
    assert req.finish_reason == "stop"


def test_held_back_eos_at_length_limit_finishes_by_length() -> None:
    req = make_request(min_tokens=2, max_tokens=2)
    assert feed(req, [50, EOS]) == 2
    assert req.finish_reason == "length"


def test_prompt_is_copied_unless_handed_over() -> None:
    ids = [5, 6, 7]
    copied = Request("c", ids)
    assert copied.prompt_token_ids == ids and copied.prompt_token_ids is not ids
    kept = Request("k", ids, copy_prompt=False)
    assert kept.prompt_token_ids is ids
    # token_ids grows with the output: its own list either way, the prompt unchanged.
    for req in (copied, kept):
        assert req.token_ids == ids and req.token_ids is not ids
        req.append_output_token(9)
        assert req.prompt_token_ids == [5, 6, 7]
    # Anything but a list is copied into one (a generator can be read once).
    gen = Request("g", (t for t in ids), copy_prompt=False)
    assert gen.prompt_token_ids == ids == gen.token_ids
    assert type(gen.prompt_token_ids) is list
