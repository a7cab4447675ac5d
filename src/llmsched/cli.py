"""The `llmsched` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

import llmsched
from llmsched.core.errors import ConfigError
from llmsched.engine.policy_args import add_policy_args

# Each subcommand's module and the function adding its parser, in the order
# `--help` lists them. A command line names one subcommand, so only its
# module is imported: all of them (the server's, the benchmark client's
# asyncio) would add up to 0.14 s to every command's start-up.
_COMMANDS = {
    "simulate": ("llmsched.sim.cli", "add_simulate_parser"),
    "calibrate": ("llmsched.sim.calibrate_cli", "add_calibrate_parser"),
    "generate": ("llmsched.engine.cli", "add_generate_parser"),
    "chat": ("llmsched.engine.chat_cli", "add_chat_parser"),
    "bench": ("llmsched.bench.cli", "add_bench_parser"),
    "serve": ("llmsched.server.cli", "add_serve_parser"),
    "proxy": ("llmsched.server.proxy", "add_proxy_parser"),
}


def _replay(args: argparse.Namespace) -> int:
    from llmsched.bench.parity import compare, load_trace
    from llmsched.bench.replay import replay
    from llmsched.bench.workload import load_workload

    workload = load_workload(args.workload)
    if args.scheduling_policy is not None:
        workload.config["policy"] = args.scheduling_policy
    if args.policy_config is not None:
        workload.config["policy_config"] = args.policy_config
    shown = 0

    def show(step: int, es) -> None:
        nonlocal shown
        trace = es.scheduler_output.trace
        if trace is not None and shown < args.explain_steps:
            shown += 1
            print(trace.explain().replace(f"step {trace.step}:", f"step {step}:", 1))

    out = open(args.trace, "w") if args.trace else None  # noqa: SIM115
    try:
        summary = replay(workload, out, explain=args.explain, on_step=show if args.explain else None)
    finally:
        if out is not None:
            out.close()
    if args.explain and shown:
        print()
    print(summary.text())
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary.to_dict(), f, indent=2)
    if args.compare:
        if not args.trace:
            print("--compare needs --trace", file=sys.stderr)
            return 2
        diffs = compare(load_trace(args.trace), load_trace(args.compare))
        if diffs:
            print(f"decisions DIFFER from {args.compare}:")
            for d in diffs:
                print("  " + d)
            return 1
        print(f"decisions identical to {args.compare}")
    return 0


class CommandParser(argparse.ArgumentParser):
    """The top-level parser; an unknown argument is reported with its subcommand's usage."""

    commands: argparse._SubParsersAction | None = None

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """Parse, and let the subcommand that was given report arguments it does not know."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            sub = self.commands.choices.get(command) if self.commands is not None and command else None
            (sub or self).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def build_parser(command: str | None = None) -> CommandParser:
    """The argument parser with every subcommand, or with ``command``'s alone (and replay's)."""
    p = CommandParser(prog="llmsched", description=llmsched.__doc__)
    p.add_argument("--version", action="version", version=f"llmsched {llmsched.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "replay",
        help="replay a workload through the scheduler with fabricated tokens",
        description="Replay a workload (JSON) through the scheduler with no model, writing one "
        "JSON line per schedule() call.",
    )
    r.add_argument("workload", help="workload JSON file")
    r.add_argument("--trace", metavar="OUT.jsonl", help="write the step trace here")
    r.add_argument("--explain", action="store_true", help="record why each request did or did not run")
    r.add_argument(
        "--explain-steps",
        type=int,
        default=3,
        metavar="N",
        help="with --explain, print the first N steps' explanations (default 3)",
    )
    r.add_argument("--compare", metavar="REF.jsonl", help="check decisions against a reference trace")
    r.add_argument("--summary-json", metavar="PATH", help="write the summary as JSON")
    add_policy_args(r, default=None)
    r.set_defaults(func=_replay)
    for name, (module, add) in _COMMANDS.items():
        if command is None or command == name:
            getattr(importlib.import_module(module), add)(sub)
    p.commands = sub
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `llmsched` script."""
    words = sys.argv[1:] if argv is None else list(argv)
    # Anything but a subcommand first (--help, a typo) gets the whole parser.
    command = words[0] if words and (words[0] in _COMMANDS or words[0] == "replay") else None
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly.
        sys.stderr.close()
        return 0
    except (ConfigError, ValueError, OSError) as e:
        print(f"llmsched {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
