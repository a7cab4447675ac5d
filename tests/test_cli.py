"""The `llmsched replay` command: trace files, --explain, --compare, and errors on bad workloads."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import llmsched
from llmsched.cli import main

WORKLOAD = {
    "config": {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4},
    "requests": [
        {"id": "a", "prompt_token_ids": [1, 2, 3, 4, 5], "max_tokens": 2},
        {"id": "b", "prompt_token_ids": [9, 8, 7], "max_tokens": 1},
        {"id": "c", "arrival_step": 10, "prompt_token_ids": [4, 4, 4, 4], "max_tokens": 1},
    ],
}


def write_workload(tmp_path: Path, data: object = WORKLOAD, name: str = "wl.json") -> Path:
    """Write ``data`` as a workload file and return its path."""
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def read_jsonl(path: Path) -> list[dict]:
    """Every JSON line of ``path``."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_replay_writes_a_header_and_one_line_per_schedule_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = write_workload(tmp_path)
    trace = tmp_path / "out.jsonl"
    summary = tmp_path / "summary.json"
    assert main(["replay", str(wl), "--trace", str(trace), "--summary-json", str(summary)]) == 0
    lines = read_jsonl(trace)
    header, steps = lines[0], lines[1:]
    assert header["header"]["llmsched_version"] == llmsched.__version__
    assert header["header"]["num_requests"] == 3
    assert header["header"]["resolved"]["block_size"] == 4
    # Two steps of work, one reporting the last finish; then the engine idles
    # until step 10, when c arrives, runs, and is reported in step 11.
    assert [s["step"] for s in steps] == [0, 1, 2, 10, 11]
    assert [s["sched"] for s in steps] == [[["a", 5], ["b", 3]], [["a", 1]], [], [["c", 4]], []]
    assert [s["finished"] for s in steps] == [["b"], ["a"], [], ["c"], []]
    assert [s["total_tokens"] for s in steps] == [8, 1, 0, 4, 0]
    assert steps[0]["admitted"] == [["a", 0, "new"], ["b", 0, "new"]]
    for s in steps:
        assert set(s) >= {
            "step",
            "sched",
            "admitted",
            "preempted",
            "finished",
            "total_tokens",
            "num_running",
            "num_waiting",
            "kv_usage",
            "schedule_ns",
            "update_ns",
        }
        assert "why" not in s
    stats = json.loads(summary.read_text())
    assert stats["num_steps"] == len(steps) == 5
    assert stats["num_nonempty_steps"] == 3
    assert stats["num_finished"] == stats["num_requests"] == 3
    out = capsys.readouterr().out
    assert "3/3 finished" in out
    assert "5 (3 with tokens scheduled)" in out


def test_replay_without_trace_only_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = write_workload(tmp_path)
    assert main(["replay", str(wl)]) == 0
    out = capsys.readouterr().out
    assert "requests     3/3 finished" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wl.json"]


def test_explain_adds_why_and_prints_explanations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path)
    trace = tmp_path / "out.jsonl"
    assert main(["replay", str(wl), "--trace", str(trace), "--explain"]) == 0
    steps = read_jsonl(trace)[1:]
    assert all("why" in s for s in steps)
    assert steps[0]["why"]["entries"] == [
        ["a", 5, "scheduled", "admitted, prefill 0-5 of 5"],
        ["b", 3, "scheduled", "admitted, prefill 0-3 of 3"],
    ]
    out = capsys.readouterr().out
    assert "step 0: 2 requests ran 8 tokens" in out
    assert "  a: ran 5 tokens (admitted, prefill 0-5 of 5)" in out
    assert "step 1: 1 request ran 1 tokens" in out
    # Three steps by default: step 10 is not printed.
    assert "step 2:" in out and "step 10:" not in out


def test_explain_steps_limits_what_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path)
    assert main(["replay", str(wl), "--explain", "--explain-steps", "4"]) == 0
    out = capsys.readouterr().out
    # Printed steps carry the replay step counter, not the scheduler's own.
    assert "step 10: 1 request ran 4 tokens" in out
    assert main(["replay", str(wl), "--explain", "--explain-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "step 0:" in out and "step 1:" not in out


def test_compare_identical_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path)
    ref = tmp_path / "ref.jsonl"
    assert main(["replay", str(wl), "--trace", str(ref)]) == 0
    ours = tmp_path / "ours.jsonl"
    capsys.readouterr()
    # --explain adds fields but changes no decision.
    assert main(["replay", str(wl), "--trace", str(ours), "--compare", str(ref), "--explain"]) == 0
    assert f"decisions identical to {ref}" in capsys.readouterr().out


def test_compare_different_exits_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path)
    ref = tmp_path / "ref.jsonl"
    assert main(["replay", str(wl), "--trace", str(ref)]) == 0
    lines = read_jsonl(ref)
    lines[1]["sched"] = lines[1]["sched"][::-1]
    ref.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    capsys.readouterr()
    assert main(["replay", str(wl), "--trace", str(tmp_path / "ours.jsonl"), "--compare", str(ref)]) == 1
    out = capsys.readouterr().out
    assert f"decisions DIFFER from {ref}" in out
    assert "sched" in out


def test_compare_detects_a_missing_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path)
    ref = tmp_path / "ref.jsonl"
    assert main(["replay", str(wl), "--trace", str(ref)]) == 0
    lines = read_jsonl(ref)
    ref.write_text("".join(json.dumps(rec) + "\n" for rec in lines[:-2]))
    assert main(["replay", str(wl), "--trace", str(tmp_path / "ours.jsonl"), "--compare", str(ref)]) == 1


def test_compare_against_a_recorded_vllm_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = Path(__file__).resolve().parent / "data" / "parity"
    ref = data / "p2_preemption.vllm.jsonl"
    trace = tmp_path / "ours.jsonl"
    argv = ["replay", str(data / "p2_preemption.workload.json"), "--trace", str(trace), "--compare", str(ref)]
    assert main(argv) == 0
    assert "decisions identical" in capsys.readouterr().out
    steps = read_jsonl(trace)[1:]
    assert sum(len(s["preempted"]) for s in steps) > 0


def test_compare_needs_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path)
    assert main(["replay", str(wl), "--compare", str(wl)]) == 2
    assert "--compare needs --trace" in capsys.readouterr().err


def test_compare_with_missing_reference_exits_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = write_workload(tmp_path)
    missing = tmp_path / "nope.jsonl"
    assert main(["replay", str(wl), "--trace", str(tmp_path / "o.jsonl"), "--compare", str(missing)]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_missing_workload_exits_two_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "does-not-exist.json"
    assert main(["replay", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmsched replay: error:")
    assert str(missing) in err


@pytest.mark.parametrize("text", ["{not json", "", '{"config": {}, "requests": [1, '])
def test_malformed_workload_exits_two_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    wl = tmp_path / "broken.json"
    wl.write_text(text)
    assert main(["replay", str(wl)]) == 2
    err = capsys.readouterr().err
    assert str(wl) in err
    assert "not valid JSON" in err


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "'config' and 'requests'"),
        ({"config": {}}, "'config' and 'requests'"),
        ({"config": {}, "requests": []}, "no requests"),
        ({"requests": [{"id": "x", "max_tokens": 2}]}, "neither prompt_token_ids nor prompt_len"),
        ({"requests": [{"id": "x", "prompt_len": 4}]}, "no max_tokens"),
        (
            {
                "requests": [
                    {"id": "x", "prompt_len": 4, "max_tokens": 1},
                    {"id": "x", "prompt_len": 4, "max_tokens": 1},
                ]
            },
            "appears twice",
        ),
        ({"config": {"block_size": 3}, "requests": [{"prompt_len": 4, "max_tokens": 1}]}, "block_size"),
    ],
)
def test_invalid_workload_content_exits_two(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: object, message: str
) -> None:
    wl = write_workload(tmp_path, data)
    assert main(["replay", str(wl)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("data", [{"requests": [1]}, {"requests": {"a": 1}}, {"requests": ["a"]}])
def test_request_entries_that_are_not_objects_exit_two(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: object
) -> None:
    wl = write_workload(tmp_path, data, name="entries.json")
    assert main(["replay", str(wl)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmsched replay: error:")
    assert "entries.json" in err


def test_invalid_workload_content_error_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = write_workload(tmp_path, {"requests": [{"id": "x", "prompt_len": 4}]}, name="no-max-tokens.json")
    assert main(["replay", str(wl)]) == 2
    err = capsys.readouterr().err
    assert "no max_tokens" in err
    assert "no-max-tokens.json" in err


def test_unknown_workload_config_keys_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {**WORKLOAD, "config": {**WORKLOAD["config"], "bogus": 1, "max_num_seq": 4}}
    wl = write_workload(tmp_path, data)
    trace = tmp_path / "out.jsonl"
    assert main(["replay", str(wl), "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "unknown workload config keys: ['bogus', 'max_num_seq']" in err
    assert not trace.exists()


def test_ignored_reference_driver_keys_are_accepted(tmp_path: Path) -> None:
    data = {**WORKLOAD, "config": {**WORKLOAD["config"], "log_stats": True, "gc_freeze": False}}
    assert main(["replay", str(write_workload(tmp_path, data))]) == 0


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmsched {llmsched.__version__}"


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_console_script(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "llmsched"
    assert script.exists(), f"{script} is not installed"
    wl = write_workload(tmp_path)
    trace = tmp_path / "out.jsonl"
    done = subprocess.run(
        [str(script), "replay", str(wl), "--trace", str(trace)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "3/3 finished" in done.stdout
    lines = read_jsonl(trace)
    assert "header" in lines[0] and len(lines) == 6
    bad = subprocess.run(
        [str(script), "replay", str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "missing.json" in bad.stderr


def _parsers(parser: argparse.ArgumentParser):
    """The parser and every subcommand's, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_subcommands_help_renders():
    from llmsched.cli import build_parser

    seen = []
    for p in _parsers(build_parser()):
        # A stray % in a help string only fails here, when argparse formats it.
        text = p.format_help()
        assert text.startswith("usage: "), p.prog
        seen.append(p.prog)
    assert {"llmsched simulate", "llmsched serve", "llmsched calibrate"} <= set(seen)


def test_a_command_imports_only_its_own_subcommand() -> None:
    # In a fresh interpreter: this process has imported every module already.
    code = (
        "import sys; from llmsched.cli import main; "
        "rc = main(['simulate', '--model', 'llama-3-8b', '--hardware', 'h100', '--num-prompts', '2']); "
        "print(rc, sorted(m for m in sys.modules if m.startswith(('llmsched.server', 'llmsched.bench.cli', "
        "'llmsched.bench.serve', 'llmsched.engine.chat', 'asyncio'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 []"


def test_an_unknown_command_is_refused_with_every_choice(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulat"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'simulat'" in err
    for name in ("replay", "simulate", "calibrate", "generate", "chat", "bench", "serve", "proxy"):
        assert f"'{name}'" in err
