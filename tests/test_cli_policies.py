"""--scheduling-policy and --policy-config on the command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from llmsched.cli import main
from llmsched.engine.args import EngineArgs

# Request 0 holds most of the cache; 1 cannot fit beside it; 2 can.
WORKLOAD = {
    "config": {"num_gpu_blocks": 21, "max_model_len": 512, "max_num_batched_tokens": 256},
    "requests": [
        {"id": "big", "arrival_step": 0, "prompt_len": 180, "max_tokens": 40},
        {"id": "blocked", "arrival_step": 1, "prompt_len": 190, "max_tokens": 4},
        {"id": "small", "arrival_step": 2, "prompt_len": 10, "max_tokens": 4},
    ],
}


def test_replay_runs_the_chosen_policy_and_traces_its_decisions(tmp_path: Path) -> None:
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps(WORKLOAD))
    trace = tmp_path / "t.jsonl"
    args = [
        "replay", str(wl), "--trace", str(trace), "--explain",
        "--scheduling-policy", "skip-admission", "--policy-config", '{"skip_limit": 3}',
    ]  # fmt: skip
    assert main(args) == 0
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert lines[0]["header"]["resolved"]["policy"] == "skip-admission"
    assert lines[0]["header"]["resolved"]["policy_config"] == {"skip_limit": 3}
    reasons = {e[2] for rec in lines[1:] for e in rec.get("why", {}).get("entries", []) if e[0] == "blocked"}
    assert "skipped_no_room" in reasons


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scheduling-policy", "lifo"], "unknown policy 'lifo'"),
        (["--scheduling-policy", "sjf+fair"], "at most one ordering policy"),
        (["--policy-config", "[1]"], "must be a JSON object"),
        (["--policy-config", "{bad"], "not valid JSON"),
    ],
)
def test_bad_policy_flags_are_argparse_errors(flags: list[str], message: str, capsys) -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(flags)
    assert message in capsys.readouterr().err


def test_engine_args_carry_the_policy_config_into_the_scheduler_config() -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--scheduling-policy", "fair", "--policy-config", '{"output_weight": 1}'])
    a = EngineArgs.from_cli_args(ns)
    assert a.scheduling_policy == "fair" and a.policy_config == {"output_weight": 1}
