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


class _Out:
    """One output delta, as LLMEngine.step gives them."""

    def __init__(self, text: str, finished: bool) -> None:
        self.outputs = [type("Completion", (), {"text": text})()]
        self.finished = finished
        self.error = None


class _StubEngine:
    """Streams fixed deltas (with line breaks inside) for one request."""

    def __init__(self, deltas: list[str]) -> None:
        self.tokenizer = type("Tok", (), {"encode": lambda self, text, add_special_tokens: [1]})()
        self._deltas = deltas

    def add_request(self, *args: object, **kwargs: object) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self._deltas)

    def step(self) -> list[_Out]:
        text = self._deltas.pop(0)
        return [_Out(text, not self._deltas)]


def test_the_answer_is_written_with_real_line_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmsched.engine import chat_cli

    monkeypatch.setattr(chat_cli, "render_chat_prompt", lambda tokenizer, history: "prompt")
    out = io.StringIO()
    answer = chat_cli.answer_streaming(_StubEngine(["1. Eat", "\n2.", " Sleep"]), [], None, out)  # type: ignore[arg-type]
    assert answer == "1. Eat\n2. Sleep"
    assert out.getvalue() == "1. Eat\n2. Sleep\n"


def test_chat_prints_each_question_and_answer_on_lines_of_their_own(
    use_embedded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The embedded model (random weights) is enough to check the layout the README shows.
    rc = main(
        ["chat", "--model", str(use_embedded), "--prompt", "What is the capital of France?",
         "--prompt", "What do bees make?", "--max-tokens", "6"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.split("\n")
    assert lines[0] == "> What is the capital of France?"
    assert "> What do bees make?" in lines[1:]
    assert out.endswith("\n") and "\\n> " not in out


def test_the_real_models_answers_print_line_breaks_not_backslash_n(
    smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["chat", "--model", str(smollm2_gguf), "--prompt", "Give me three tips for staying healthy."])
    out = capsys.readouterr().out
    assert rc == 0
    assert "\\n" not in out
    lines = out.splitlines()
    # The answer starts on the line after the question (whether it breaks lines is the model's choice).
    assert lines[0] == "> Give me three tips for staying healthy." and lines[1].strip()
