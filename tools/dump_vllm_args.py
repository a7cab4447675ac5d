#!/usr/bin/env python3
"""Dump vLLM's `vllm serve` options and `EngineArgs` fields to JSON, for the compatibility test.

Run with a Python that has vLLM installed (the test suite never needs it; it
reads the file this writes)::

    /work/vllm-ref-venv/bin/python tools/dump_vllm_args.py --out tests/data/vllm_0_33_args.json

The serve parser is built as `vllm serve` builds it: a subparser named
``serve`` filled by ``make_arg_parser`` (the frontend arguments, then
``AsyncEngineArgs.add_cli_args``). For each option the file keeps what a
command line needs to say it: the option strings, ``dest``, whether it takes
a value (and how many), its choices, the type's name, and the default. The
``EngineArgs`` fields are the keyword arguments ``vllm.LLM(...)`` passes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any


def _kind(action: argparse.Action) -> str:
    """How an option is written on a command line: flag (no value), bool (--x/--no-x), value, or list."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool"
    if action.nargs == 0:
        return "flag"
    if action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
        return "list"
    return "value"


def _jsonable(value: Any) -> Any:
    """``value`` if JSON can hold it as is, else its repr (defaults may be enums, callables, ...)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _type_name(action: argparse.Action) -> str | None:
    t = action.type
    if t is None:
        return None
    return getattr(t, "__name__", None) or type(t).__name__


def serve_options() -> list[dict[str, Any]]:
    """Every option of `vllm serve`, in the parser's order."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    sub = top.add_subparsers(dest="subparser")
    serve = make_arg_parser(sub.add_parser("serve", usage="vllm serve [model_tag] [options]"))
    out = []
    for action in serve._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        out.append(
            {
                "option_strings": list(action.option_strings),
                "dest": action.dest,
                "kind": _kind(action) if action.option_strings else "positional",
                "nargs": _jsonable(action.nargs),
                "choices": _jsonable(list(action.choices)) if action.choices else None,
                "type": _type_name(action),
                "default": _jsonable(action.default),
            }
        )
    return out


def engine_args_fields() -> list[dict[str, Any]]:
    """The fields of vLLM's ``EngineArgs`` dataclass (the keyword arguments of ``LLM``)."""
    from vllm.engine.arg_utils import EngineArgs

    out = []
    for f in dataclasses.fields(EngineArgs):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = "<factory>"
        else:
            default = "<required>"
        out.append({"name": f.name, "type": str(f.type), "default": _jsonable(default)})
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the JSON file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    # The parser's defaults read the platform; a machine without a GPU needs telling it is a CPU one.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm

    data = {
        "source": f"vllm {vllm.__version__}: `vllm serve` parser (make_arg_parser) and EngineArgs fields, "
        "written by tools/dump_vllm_args.py on the CPU platform",
        "vllm_version": vllm.__version__,
        "serve_options": serve_options(),
        "engine_args_fields": engine_args_fields(),
    }
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    print(
        f"{args.out}: {len(data['serve_options'])} serve options, "
        f"{len(data['engine_args_fields'])} EngineArgs fields",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
