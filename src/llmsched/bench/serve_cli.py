"""`llmsched bench serve`: latency and throughput of a running server, measured by an HTTP client."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from llmsched.core.errors import ConfigError
from llmsched.engine.arg_types import positive_int

# Server-side counters reported next to the client's figures: name -> key in the result's "engine".
_ENGINE_COUNTERS = {
    "llmsched:engine_steps_total": "num_steps",
    "vllm:num_preemptions_total": "num_preemptions",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:generation_tokens_total": "generation_tokens",
}


def _rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 (or inf)")
    return v


def add_serve_bench_parser(bsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench serve` on the `bench` subparsers."""
    p = bsub.add_parser(
        "serve",
        help="online serving: stream completions from a running server, report TTFT/TPOT/ITL and throughput",
        description="Send --num-prompts streamed /v1/completions requests to a running server (llmsched "
        "serve, vLLM, or any OpenAI-compatible server) at --request-rate with at most --max-concurrency in "
        "flight, and report latency percentiles and throughput under the same keys as `bench throughput`.",
    )
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's default)")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--backend", choices=("openai", "vllm"), default="openai", help="recorded in the result (as vLLM)"
    )
    p.add_argument("--endpoint", default="/v1/completions", help="completions path (default /v1/completions)")
    p.add_argument(
        "--tokenizer", default=None, help="recorded as tokenizer_id; prompts are token ids, so none is loaded"
    )
    w = p.add_argument_group("workload (vLLM benchmark arguments)")
    w.add_argument(
        "--dataset-name",
        choices=("random", "custom", "jsonl"),
        default=None,
        help="random: --random-input-len random token ids per prompt (seeded by --seed); custom/jsonl: "
        "--dataset-path (default: random unless --dataset-path is given)",
    )
    w.add_argument("--num-prompts", type=positive_int, default=100)
    w.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s, Poisson (default inf)")
    w.add_argument(
        "--burstiness",
        type=_rate,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 is Poisson, lower is burstier (default 1, as vLLM)",
    )
    w.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight at most")
    w.add_argument("--input-len", "--random-input-len", dest="input_len", type=positive_int, default=1024)
    w.add_argument("--output-len", "--random-output-len", dest="output_len", type=positive_int, default=128)
    w.add_argument(
        "--dataset",
        "--dataset-path",
        dest="dataset",
        metavar="FILE.jsonl",
        help="one JSON object per line: prompt, prompt_token_ids or prompt_len; output_len",
    )
    w.add_argument("--seed", type=int, default=0, help="seeds the random dataset and the arrivals")
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length, past EOS (default on; vLLM's client defaults to off)",
    )
    w.add_argument(
        "--json-schema",
        metavar="FILE.json",
        default=None,
        help="structured-output workload: send every request (without a json_schema of its own) "
        "with this schema as its response_format",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--result-json",
        "--result-filename",
        dest="result_json",
        metavar="PATH",
        help="write the result here (with --save-result: the file name inside --result-dir)",
    )
    o.add_argument(
        "--save-result", action="store_true", help="write the result to --result-dir, named as vLLM names it"
    )
    o.add_argument("--result-dir", default=None, help="folder of --save-result (default: the current one)")
    o.add_argument("--save-detailed", action="store_true", help="add vLLM's per-request lists to the result")
    o.add_argument(
        "--label", default=None, help="recorded in the result and its file name (default: --backend)"
    )
    o.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated (default 50,90,99)")
    o.add_argument("--goodput", nargs="*", metavar="KEY:MS", help="SLOs, e.g. ttft:300 tpot:50")
    o.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_bench_serve)
    return p


def run_bench_serve(args: argparse.Namespace) -> int:
    """Build the workload, run the client, print the table, write --result-json."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ConfigError("llmsched bench serve needs aiohttp: pip install 'llmsched[serve]'") from None
    from llmsched.bench.metrics import format_summary, parse_goodput, parse_percentiles
    from llmsched.bench.serve import RANDOM_PROMPT_IDS, ServeBenchConfig, run_serve_bench, scrape_metrics
    from llmsched.bench.serve_result import detailed_lists, result_header, result_path, today
    from llmsched.bench.throughput import load_dataset, load_json_schema, synthetic_requests, with_json_schema

    percentiles = parse_percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)
    vocab = list(RANDOM_PROMPT_IDS)
    if args.dataset_name == "random" and args.dataset:
        raise ConfigError("--dataset-name random draws its prompts; drop --dataset-path or name custom")
    if args.dataset_name in ("custom", "jsonl") and not args.dataset:
        raise ConfigError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE.jsonl")
    if args.dataset:
        requests = load_dataset(args.dataset, args.output_len, vocab, args.num_prompts, seed=args.seed)
    else:
        requests = synthetic_requests(
            args.num_prompts, args.input_len, args.output_len, vocab, seed=args.seed
        )
    with_json_schema(requests, load_json_schema(args.json_schema) if args.json_schema else None)
    cfg = ServeBenchConfig(
        base_url=args.base_url,
        model=args.model,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        api_key=args.api_key,
        seed=args.seed,
        endpoint=args.endpoint,
        burstiness=args.burstiness,
        ignore_eos=args.ignore_eos,
    )
    date = today()
    out_path = result_path(args, date)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = None
    if not args.disable_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="Requests", dynamic_ncols=True)

    async def main() -> tuple:
        before = await scrape_metrics(args.base_url, args.api_key)
        result = await run_serve_bench(cfg, requests, on_done=(lambda _: bar.update(1)) if bar else None)
        after = await scrape_metrics(args.base_url, args.api_key)
        return result, before, after

    result, before, after = asyncio.run(main())
    if bar is not None:
        bar.close()
    summary = result.summary(percentiles, goodput or None)
    engine = {
        key: after[name] - before.get(name, 0.0) for name, key in _ENGINE_COUNTERS.items() if name in after
    }
    if engine.get("prefix_cache_queries"):
        engine["prefix_cache_hit_rate"] = engine["prefix_cache_hits"] / engine["prefix_cache_queries"]
    extra = [("Server engine steps:", int(engine["num_steps"]))] if "num_steps" in engine else []
    if "num_preemptions" in engine:
        extra.append(("Server preemptions:", int(engine["num_preemptions"])))
    print(
        format_summary(
            summary,
            title="Serving Benchmark Result",
            percentiles=percentiles,
            extra=extra,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
        )
    )
    for err in result.errors[:5]:
        print(f"failed: {err}", file=sys.stderr)
    if out_path is not None:
        data = result_header(args, date, len(requests))
        data.update(summary)
        data.update(base_url=args.base_url, model=args.model, engine=engine, errors=result.errors[:20])
        if args.save_detailed:
            data.update(detailed_lists(result.timings, result.errors))
        with open(out_path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {out_path}")
    return 1 if result.errors else 0
