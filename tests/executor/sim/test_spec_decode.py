"""The simulator's acceptance model and speculative-config parsing."""

from __future__ import annotations

import pytest

from llmsched.core.errors import ConfigError
from llmsched.executor.sim.spec_decode import AcceptanceModel, SimSpecDecode, parse_sim_speculative_config


def test_acceptance_draws_follow_the_rates() -> None:
    s = parse_sim_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "acceptance_rate": 0.5})
    sd = SimSpecDecode(s.config, s.acceptance, seed=3)
    draws = [sd.accepted(4) for _ in range(20000)]
    assert max(draws) == 4 and min(draws) == 0
    mean = sum(draws) / len(draws)
    assert mean == pytest.approx(s.acceptance.expected_accepted(4), abs=0.03)
    assert s.acceptance.expected_accepted(4) == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625)
    # Fewer drafts scheduled (near max_model_len): never more accepted than verified.
    assert all(sd.accepted(1) <= 1 for _ in range(100))
    again = SimSpecDecode(s.config, s.acceptance, seed=3)
    assert [again.accepted(4) for _ in range(20000)] == draws


def test_per_position_rates_repeat_the_last() -> None:
    m = AcceptanceModel.parse("0.9,0.5")
    assert [m.rate(p) for p in range(4)] == [0.9, 0.5, 0.5, 0.5]
    assert AcceptanceModel.parse([1, 1]).expected_accepted(3) == 3


def test_parse_keeps_vllm_keys_and_names_errors() -> None:
    s = parse_sim_speculative_config('{"draft_model": "llama-3.2-1b", "num_speculative_tokens": 2}', "0.6")
    assert s.config.method == "draft_model" and s.draft_model == "llama-3.2-1b"
    assert s.config.num_lookahead_tokens == 2
    assert s.acceptance.rates == (0.6,)
    with pytest.raises(ConfigError, match="unknown key"):
        parse_sim_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "0.5")
    with pytest.raises(ConfigError, match="not both"):
        parse_sim_speculative_config(
            {"method": "ngram", "num_speculative_tokens": 2, "acceptance_rate": 0.5, "acceptance_rates": [1]}
        )
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_sim_speculative_config("{nope", "0.5")
    with pytest.raises(ConfigError, match="comma-separated"):
        AcceptanceModel.parse("high")


def test_llama_3_2_1b_draft_shape() -> None:
    from llmsched.executor.sim.model_shapes import load_model

    m = load_model("meta-llama/Llama-3.2-1B-Instruct")
    assert m.name == "llama-3.2-1b" and m.tie_word_embeddings
    assert m.num_params() / 1e9 == pytest.approx(1.24, abs=0.01)
