"""`llmsched generate`: complete a few prompts from the command line."""

from __future__ import annotations

import argparse
import math
import sys

from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.args import EngineArgs


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags named as SamplingParams fields; unset ones take the model's defaults."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most (default 16)")
    g.add_argument(
        "--temperature", type=float, default=None, help="0 for greedy (default: model's, else 1.0)"
    )
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None, help="0 or -1 disables")
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=[], metavar="ID")
    g.add_argument("--include-stop-str-in-output", action="store_true")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, metavar="N", help="return the top-N logprobs")


def sampling_params_from_args(args: argparse.Namespace, defaults: dict) -> SamplingParams:
    """SamplingParams from the flags, with the model's generation defaults under them."""
    given = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
    }
    merged = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    return SamplingParams(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        # --seed (an engine flag, as in vLLM) also seeds each request, so the
        # same command prints the same text every time.
        seed=args.seed,
        stop=list(args.stop),
        stop_token_ids=list(args.stop_token_ids),
        include_stop_str_in_output=args.include_stop_str_in_output,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        **merged,
    )


def add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `generate` subcommand on ``sub``."""
    p = sub.add_parser(
        "generate",
        help="generate completions for prompts with a real model (default: the embedded demo model)",
        description="Complete each --prompt with the torch executor and print the text, why it "
        "stopped and its latency. With no --model the embedded demo model (random weights) runs.",
    )
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    add_sampling_args(p)
    EngineArgs.add_cli_args(p)
    p._option_string_actions["--seed"].help = "seeds the engine and every prompt's sampling (default 0)"
    p.set_defaults(func=run_generate)
    return p


def run_generate(args: argparse.Namespace) -> int:
    """Build the engine, generate for every prompt, print the results."""
    from llmsched.engine.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    try:
        params = sampling_params_from_args(args, llm.llm_engine.generation_defaults)
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    finally:
        llm.close()
    failed = 0
    for out in outputs:
        c = out.outputs[0]
        print(f"Prompt: {out.prompt!r}")
        if out.error is not None:
            failed += 1
            print(f"  error: {out.error}")
            continue
        print(f"Generated text: {c.text!r}")
        m = out.metrics
        timing = ""
        if m is not None and not math.isnan(m.ttft):
            timing = f", TTFT {m.ttft * 1e3:.1f} ms, TPOT {m.tpot * 1e3:.1f} ms"
        stop = f" ({c.stop_reason!r})" if c.stop_reason is not None else ""
        print(f"  finish_reason={c.finish_reason}{stop}, {len(c.token_ids)} tokens{timing}")
        if c.logprobs:
            print(f"  cumulative_logprob={c.cumulative_logprob}")
    if failed:
        print(f"{failed} of {len(outputs)} prompts failed", file=sys.stderr)
        return 1
    return 0
