"""`llmsched bench throughput`: offline throughput of the real engine on a model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llmsched.bench.metrics import parse_percentiles
from llmsched.bench.serve_cli import add_serve_bench_parser
from llmsched.core.errors import ConfigError
from llmsched.engine.arg_types import positive_int
from llmsched.engine.args import EngineArgs
from llmsched.engine.dp.cli_args import add_dp_args


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench` and its `throughput` and `serve` subcommands on ``sub``."""
    bench = sub.add_parser("bench", help="benchmark the engine on a real model")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser(
        "throughput",
        help="offline throughput: queue a batch, run it to the end, report tokens/s and latencies",
        description="Queue every prompt at once, run the engine until all finish, and print "
        "requests/s, input/output tokens/s and TTFT/TPOT statistics (vLLM's metric names). With no "
        "--model the embedded demo model (random weights) runs.",
    )
    w = p.add_argument_group("workload (vLLM benchmark arguments)")
    w.add_argument("--input-len", "--random-input-len", dest="input_len", type=positive_int, default=1024)
    w.add_argument("--output-len", "--random-output-len", dest="output_len", type=positive_int, default=128)
    w.add_argument("--num-prompts", type=positive_int, default=None, help="requests (default 100)")
    w.add_argument(
        "--dataset",
        "--dataset-path",
        dest="dataset",
        metavar="FILE.jsonl",
        help="one JSON object per line: prompt, prompt_token_ids or prompt_len; output_len; "
        "json_schema (optional)",
    )
    w.add_argument(
        "--json-schema",
        metavar="FILE.json",
        default=None,
        help="structured-output workload: constrain every request (without a json_schema of its own) "
        "to this JSON schema",
    )
    o = p.add_argument_group("output")
    o.add_argument("--result-json", "--output-json", dest="result_json", metavar="PATH")
    o.add_argument(
        "--explain-steps",
        type=int,
        default=0,
        metavar="N",
        help="print the scheduler's decisions for the first N steps (why each request did or did not run)",
    )
    o.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated (default 50,90,99)")
    o.add_argument("--disable-tqdm", action="store_true")
    EngineArgs.add_cli_args(p)
    add_dp_args(p, real=True)
    p.set_defaults(func=run_bench_throughput)
    add_serve_bench_parser(bsub)
    return bench


def run_bench_throughput(args: argparse.Namespace) -> int:
    """Build the engine and workload, run, print the table, write --result-json."""
    from llmsched.bench.throughput import (
        load_dataset,
        load_json_schema,
        run_throughput,
        synthetic_requests,
        vocab_ids_for_prompts,
        with_json_schema,
    )
    from llmsched.engine.llm_engine import LLMEngine

    percentiles = parse_percentiles(args.metric_percentiles)
    if args.explain_steps < 0:
        raise ConfigError(f"--explain-steps {args.explain_steps} must be >= 0")
    if args.data_parallel_size > 1 or args.balance_scheduling or args.prefill_schedule_interval > 1:
        from llmsched.engine.dp.bench import run_dp_throughput

        if args.json_schema:
            raise ConfigError("--json-schema is not supported with data parallelism or a prefill cadence")

        return run_dp_throughput(args, percentiles)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    schema = load_json_schema(args.json_schema) if args.json_schema else None
    engine_args = EngineArgs.from_cli_args(args)
    engine = LLMEngine(engine_args)
    if engine.model_notice:
        print(engine.model_notice, file=sys.stderr)
    try:
        vocab = vocab_ids_for_prompts(engine)
        if args.dataset:
            requests = load_dataset(args.dataset, args.output_len, vocab, args.num_prompts, seed=args.seed)
            workload = f"{len(requests)} prompts from {args.dataset}"
        else:
            n = args.num_prompts if args.num_prompts is not None else 100
            requests = synthetic_requests(n, args.input_len, args.output_len, vocab, seed=args.seed)
            workload = f"{n} prompts x {args.input_len} random tokens, {args.output_len} output tokens each"
        with_json_schema(requests, schema)
        if any(r.json_schema is not None for r in requests):
            workload += ", JSON-schema constrained"
        cfg = engine.scheduler_config
        model = str(engine.model_path) + (
            " (embedded demo model, RANDOM weights)" if engine.is_embedded else ""
        )
        print(f"model      {model}")
        ex = engine.executor
        where = " ".join(
            f"{k}={str(getattr(ex, k)).removeprefix('torch.')}"
            for k in ("device", "dtype")
            if getattr(ex, k, None) is not None
        )
        print(
            f"engine     max_num_batched_tokens={cfg.max_num_batched_tokens} max_num_seqs={cfg.max_num_seqs} "
            f"block_size={cfg.block_size} num_gpu_blocks={cfg.num_gpu_blocks} "
            f"max_model_len={cfg.max_model_len}" + (f" {where}" if where else "")
        )
        print(f"workload   {workload} (ignore_eos, all queued before the first step)")
        print()
        result = run_throughput(
            engine,
            requests,
            explain_steps=args.explain_steps,
            on_explain=lambda text: print(text + "\n"),
            percentiles=percentiles,
            progress=not args.disable_tqdm,
        )
    finally:
        engine.close()
    print(result.table())
    s = result.summary
    print(
        f"Throughput: {s['request_throughput']:.2f} requests/s, "
        f"{s['total_token_throughput']:.2f} total tokens/s, {s['output_throughput']:.2f} output tokens/s"
    )
    for rid, why in result.rejections[:5]:
        print(f"failed {rid}: {why}")
    if args.result_json:
        data = result.to_json()
        data["model"] = str(engine.model_path)
        data["random_weights"] = engine.is_embedded
        data["engine_args"] = dict(vars(engine_args))
        with open(args.result_json, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {args.result_json}")
    return 1 if result.rejections else 0
