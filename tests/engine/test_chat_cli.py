"""`llmsched chat` and `LLM.chat` on the real model (SmolLM2-135M-Instruct; skipped when not fetchable)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from llmsched import LLM, SamplingParams
from llmsched.cli import main


def test_chat_answers_each_prompt_keeping_the_conversation(
    smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        ["chat", "--model", str(smollm2_gguf), "--prompt", "What is the capital of France?",
         "--prompt", "What is the capital of Italy?"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    first, second = out.split("> What is the capital of Italy?")
    assert "> What is the capital of France?" in first and "Paris" in first
    assert "Rome" in second


def test_chat_with_no_prompt_reads_questions_until_exit(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n\nexit\nnever asked\n"))
    assert main(["chat", "--model", str(smollm2_gguf), "--max-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "never" not in captured.out
    assert captured.err.count("you> ") == 3


def test_llm_chat_answers_a_batch_of_conversations(smollm2_gguf: Path) -> None:
    llm = LLM(model=str(smollm2_gguf))
    try:
        outs = llm.chat(
            [
                [{"role": "user", "content": "What is the capital of France?"}],
                [
                    {"role": "system", "content": "You answer in one word."},
                    {"role": "user", "content": "What color is the sky on a clear day?"},
                ],
            ],
            # Room to finish: the sky answer's length swings with rounding (17 tokens
            # with PyTorch's bfloat16 prefill attention, 54 with the C kernel's, 28 in float32).
            SamplingParams(max_tokens=64, temperature=0.0),
            use_tqdm=False,
        )
    finally:
        llm.close()
    assert "Paris" in outs[0].outputs[0].text
    assert "blue" in outs[1].outputs[0].text.lower()
    assert outs[0].prompt.startswith("<|im_start|>system")
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
