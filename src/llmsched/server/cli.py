"""`llmsched serve`: the OpenAI-compatible server (needs the `serve` extra)."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.batch_defaults import UsageContext
from llmsched.engine.vllm_flags import add_vllm_flags
from llmsched.server.args import ServerArgs


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `serve` subcommand on ``sub``."""
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (default: the embedded demo model)",
        description="Serve /v1/completions, /v1/chat/completions (streaming, n > 1) and /v1/models, "
        "/tokenize and /detokenize, plus /health, /ping, /version, /metrics (Prometheus, vLLM's names) "
        "and /debug/steps (the scheduler's decisions). SIGTERM drains, then exits 0. "
        "With no --model the embedded demo model (random weights) runs.",
        epilog="Every other `vllm serve` flag of vLLM 0.33 is taken too: one with no meaning here "
        "(--enforce-eager, --disable-log-requests, ...) is ignored with a line saying so, and one asking "
        "for what llmsched cannot do (--tensor-parallel-size 2, ...) stops with what to use instead.",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model folder (same as --model, as in vLLM)",
    )
    ServerArgs.add_cli_args(p)
    EngineArgs.add_cli_args(p, usage=UsageContext.OPENAI_API_SERVER)
    # vLLM's other flags, last so that the ones above keep their own meaning.
    add_vllm_flags(p)
    p._option_string_actions["--num-threads"].help = (
        "torch CPU threads of the engine (default: every usable CPU; "
        "one fewer for a model with layers under 1M parameters)"
    )
    p.set_defaults(func=run_serve)
    return p


def report_ignored(args: argparse.Namespace, file: TextIO | None = None) -> None:
    """Say which vLLM flags were taken and ignored, one line each."""
    for note in getattr(args, "vllm_ignored", []):
        print(f"llmsched serve: {note}", file=file or sys.stderr)


def run_serve(args: argparse.Namespace) -> int:
    """Check the extra is installed, then load the model and serve until interrupted."""
    report_ignored(args)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.headless or args.api_server_count == 0:
        from llmsched.server.dp_headless import run_headless

        # No API server here: neither the HTTP extra nor a port is needed.
        return run_headless(EngineArgs.from_cli_args(args), ServerArgs.from_cli_args(args))
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"llmsched serve needs the serve extra ({e.name} is missing): pip install 'llmsched[serve]'"
        ) from None
    from llmsched.server.launch import serve

    return serve(EngineArgs.from_cli_args(args), ServerArgs.from_cli_args(args))
