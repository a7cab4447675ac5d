"""SimRequest: a scheduler Request that keeps the workload's prompt list and its client timestamps."""

from __future__ import annotations

from llmsched.core.sampling_params import SamplingParams
from llmsched.sim.requests import SimRequest


def test_keeps_the_prompt_list_it_is_given() -> None:
    prompt = [100, 101, 102, 103]
    req = SimRequest("0", prompt, SamplingParams(max_tokens=2), arrival_time=1.5, sent_time=1.25, index=0)
    assert req.prompt_token_ids is prompt
    assert req.token_ids == prompt and req.token_ids is not prompt
    req.append_output_token(7)
    assert prompt == [100, 101, 102, 103]
    assert (req.num_prompt_tokens, req.num_tokens, req.stop_length) == (4, 5, 6)
    assert (req.sent_time, req.arrival_time, req.index) == (1.25, 1.5, 0)
    assert req.first_token_time == req.last_token_time == -1.0
