"""The torch threads an engine behind `serve` gets: every usable CPU, but one for a small model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmsched.engine.args import EngineArgs
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.serve_threads import SMALL_LAYER_PARAMS, layer_params, serving_threads
from llmsched.executor.torch.embedded import CONFIG as EMBEDDED_CONFIG

SMOLLM2 = {
    "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "num_hidden_layers": 30,
}  # fmt: skip


def test_every_usable_cpu_but_one_for_a_small_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert layer_params(SMOLLM2) == 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert serving_threads(SMOLLM2) == 3
    # The embedded demo model (what `serve` runs without a model): one CPU left to HTTP.
    assert layer_params(EMBEDDED_CONFIG) < SMALL_LAYER_PARAMS
    assert serving_threads(EMBEDDED_CONFIG) == 2
    # A config that does not say, or no config: every CPU.
    assert serving_threads({"architectures": ["X"]}) == serving_threads(None) == 3
    assert serving_threads({"text_config": SMOLLM2}) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1}, raising=False)
    assert serving_threads(EMBEDDED_CONFIG) == 1


@pytest.mark.parametrize(
    ("usage_context", "num_threads", "expected"),
    [("OPENAI_API_SERVER", None, "serve"), ("LLM_CLASS", None, None), ("OPENAI_API_SERVER", 3, 3)],
)
def test_the_engine_takes_the_serve_default_only_behind_serve_and_unless_told(
    byte_model_dir: Path, fake_factory, usage_context: str, num_threads: int | None, expected: object
) -> None:
    factory = fake_factory()
    args = EngineArgs(
        model=str(byte_model_dir), device="cpu", usage_context=usage_context, num_threads=num_threads
    )
    engine = LLMEngine(args, executor_factory=factory)
    if expected == "serve":
        expected = serving_threads(engine.model_config)
    # (The fake factory drops None arguments: the executor then takes its own default.)
    assert factory.made[0].kwargs.get("num_threads") == expected
    engine.close()
