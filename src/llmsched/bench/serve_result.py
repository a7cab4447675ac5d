"""`llmsched bench serve`'s result file in `vllm bench serve`'s layout.

The header keys (date, backend, model_id, request_rate, burstiness, ...) and,
with ``--save-detailed``, the per-request lists are vLLM's, so a result from
either client feeds the same scripts. ``--save-result`` names the file as
vLLM does unless ``--result-filename`` is given.
"""

from __future__ import annotations

import argparse
import math
from datetime import datetime
from pathlib import Path

from llmsched.bench.metrics import RequestTiming


def result_path(args: argparse.Namespace, date: str) -> Path | None:
    """Where the result goes: --result-json, or --save-result's file in --result-dir; None: nowhere."""
    if args.save_result:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        model = (args.model or "model").rstrip("/").split("/")[-1]
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = args.result_json or f"{args.label or args.backend}-{rate}qps{conc}-{model}-{date}.json"
        return Path(args.result_dir or ".") / name
    return Path(args.result_json) if args.result_json else None


def result_header(args: argparse.Namespace, date: str, num_prompts: int) -> dict:
    """vLLM's keys before the metrics: setup and traffic."""
    return {
        "date": date,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": args.model,
        "tokenizer_id": args.tokenizer or args.model,
        "num_prompts": num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }


def detailed_lists(timings: list[RequestTiming], errors: list[str]) -> dict:
    """vLLM's per-request lists (--save-detailed); times in seconds, as vLLM writes them."""
    origin = min((t.start for t in timings), default=0.0)
    return {
        "input_lens": [t.prompt_len for t in timings],
        "output_lens": [t.output_len if t.success else 0 for t in timings],
        "ttfts": [t.first_token - t.start if t.success else 0.0 for t in timings],
        "itls": [list(t.itl) for t in timings],
        "latencies": [t.end - t.start if t.success else 0.0 for t in timings],
        "start_times": [t.start - origin for t in timings],
        "errors": errors,
    }


def today() -> str:
    """The date stamp vLLM puts in results and file names."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")
