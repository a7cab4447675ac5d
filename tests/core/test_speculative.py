"""--speculative-config as vLLM spells it: defaults, lookahead, and clear errors."""

from __future__ import annotations

import argparse

import pytest

from llmsched.core.errors import ConfigError
from llmsched.core.speculative import SpeculativeConfig
from llmsched.engine.args import EngineArgs


def test_ngram_bounds_default_as_vllm() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_lookahead_tokens) == (5, 5, 0)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)


def test_a_model_means_a_draft_model_with_k_lookahead_slots() -> None:
    c = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 3})
    assert c.method == "draft_model" and c.num_lookahead_tokens == 3
    assert SpeculativeConfig.parse(c.to_dict()) == c


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("{not json", "not valid JSON"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "<=",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 2}, "unknown key"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_configs_say_what_is_wrong(value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig.parse(value)  # type: ignore[arg-type]


def test_cli_flag_reaches_the_scheduler_config() -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--speculative-config", '{"model": "/d", "num_speculative_tokens": 2}'])
    args = EngineArgs.from_cli_args(ns)
    cfg = args.create_scheduler_config(num_gpu_blocks=64, max_model_len=128, block_size=16)
    assert (cfg.num_speculative_tokens, cfg.num_lookahead_tokens) == (2, 2)
    assert args.executor_kwargs()["speculative_config"].model == "/d"
    plain = EngineArgs.from_cli_args(p.parse_args([]))
    assert "speculative_config" not in plain.executor_kwargs()
