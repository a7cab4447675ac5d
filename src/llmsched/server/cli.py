"""`llmsched serve`: the OpenAI-compatible server (needs the `serve` extra)."""

from __future__ import annotations

import argparse

from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.batch_defaults import UsageContext
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
    p._option_string_actions["--num-threads"].help = (
        "torch CPU threads of the engine (default: every usable CPU; "
        "one fewer for a model with layers under 1M parameters)"
    )
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Check the extra is installed, then load the model and serve until interrupted."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
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
