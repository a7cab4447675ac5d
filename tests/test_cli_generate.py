"""`llmsched generate` end to end on the embedded model with the real torch executor."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from llmsched.cli import main


def generated(stdout: str) -> list[str]:
    """The quoted texts of the 'Generated text:' lines."""
    return [ast.literal_eval(m) for m in re.findall(r"^Generated text: (.*)$", stdout, re.MULTILINE)]


def test_generate_prints_each_prompt_its_text_and_why_it_stopped(
    use_embedded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        ["generate", "--prompt", "Hello", "--prompt", "The quick", "--max-tokens", "8", "--temperature", "0"]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert "Prompt: 'Hello'" in out and "Prompt: 'The quick'" in out
    texts = generated(out)
    assert len(texts) == 2 and all(len(t) == 8 for t in texts)
    assert out.count("finish_reason=length, 8 tokens, TTFT") == 2
    assert "RANDOM weights" in err


def test_greedy_output_is_repeatable_and_a_stop_string_cuts_it(
    use_embedded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--prompt", "Hello", "--max-tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    (full,) = generated(capsys.readouterr().out)
    stop = full[4:6]
    cut = full[: full.index(stop)]
    assert main([*args, "--stop", stop]) == 0
    out = capsys.readouterr().out
    assert generated(out) == [cut]
    assert f"finish_reason=stop ({stop!r})" in out
    assert main([*args, "--stop", stop, "--include-stop-str-in-output"]) == 0
    assert generated(capsys.readouterr().out) == [cut + stop]


def test_seeded_sampling_repeats(use_embedded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--prompt", "abc", "--max-tokens", "10", "--temperature", "1.5", "--top-k", "50"]
    assert main([*args, "--seed", "5"]) == 0
    first = generated(capsys.readouterr().out)
    assert main([*args, "--seed", "5"]) == 0
    assert generated(capsys.readouterr().out) == first


def test_an_over_long_prompt_fails_alone_with_exit_code_1(
    use_embedded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        ["generate", "--prompt", "x" * 40, "--prompt", "ok", "--max-model-len", "32", "--max-tokens", "4"]
    )
    out, err = capsys.readouterr()
    assert rc == 1
    assert "error: request" in out and "max_model_len is 32" in out
    assert len(generated(out)) == 1
    assert "1 of 2 prompts failed" in err


def test_an_unknown_model_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-model-here"
    assert main(["generate", "--model", str(missing), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "llmsched generate: error:" in err and "no-model-here" in err


def test_invalid_sampling_flags_are_reported(use_embedded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "hi", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_model_errors_from_the_executor_are_reported_cleanly(
    use_embedded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import shutil

    odd = tmp_path / "gpt2ish"
    shutil.copytree(use_embedded, odd)
    config = json.loads((odd / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (odd / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(odd), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and "Qwen3ForCausalLM" in err
    # A KV cache that cannot hold one max_model_len request says how many blocks it needs.
    argv = [
        "generate",
        "--prompt",
        "hi",
        "--num-gpu-blocks",
        "4",
        "--max-model-len",
        "256",
        "--block-size",
        "16",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs 16 blocks" in err
