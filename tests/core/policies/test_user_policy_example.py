"""The README's user-policy example loads through ``module:Class`` and does what it says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.policy_driver import Spec, config, drive

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "policies"


@pytest.fixture(autouse=True)
def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples folder importable, as PYTHONPATH would make it."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    sys.modules.pop("shortest_prompt", None)


def test_shortest_prompt_first_orders_by_prompt_and_declines_long_ones() -> None:
    specs = [Spec("r0", 0, 16, 20), Spec("r1", 1, 120, 2), Spec("r2", 1, 40, 2), Spec("r3", 1, 300, 2)]
    cfg = config(
        policy="shortest_prompt:ShortestPromptFirst", policy_config={"max_prompt": 200}, max_num_seqs=1
    )
    run = drive(cfg, specs)
    assert run.admitted_order == ["r0", "r2", "r1"]
    assert run.declined == {"r3"}
