"""`llmsched bench throughput --data-parallel-size N`: the offline throughput bench over real ranks.

The front end tokenizes nothing it does not have to: prompts are token ids
(or text encoded here once), each rank process loads the model and runs the
torch executor, and latencies are measured where the outputs arrive. The
result table and JSON keys are those of the single-engine bench.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from llmsched.bench.metrics import MetricsCollector
from llmsched.core.errors import ConfigError
from llmsched.core.request import Request
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.args import EngineArgs
from llmsched.engine.dp.cli_args import describe_dp, dp_config_from_args
from llmsched.engine.dp.engine import DPEngine
from llmsched.engine.dp.factories import TorchEngineFactory, resolve_model
from llmsched.engine.dp.proc_transport import ProcessTransport
from llmsched.engine.dp.transport import DPRankError


def _backend(choice: str, device: str) -> str:
    if choice != "auto":
        return choice
    if device == "cpu":
        return "gloo"
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def run_dp_throughput(args: argparse.Namespace, percentiles: list[float]) -> int:
    """Run the bench over ``args.data_parallel_size`` rank processes; output as the single bench's."""
    from llmsched.bench.throughput import ThroughputResult, load_dataset, synthetic_requests
    from llmsched.engine.model_files import load_model_files
    from llmsched.engine.tokenizer import load_tokenizer

    if args.data_parallel_size == 1:
        raise ConfigError(
            "--balance-scheduling and --prefill-schedule-interval need --data-parallel-size > 1"
        )
    if args.explain_steps:
        raise ConfigError("--explain-steps is not available with --data-parallel-size > 1 (ranks run apart)")
    engine_args, embedded, kv_default = resolve_model(EngineArgs.from_cli_args(args))
    if embedded:
        from llmsched.executor.torch.embedded import random_weights_notice

        print(random_weights_notice(engine_args.model), file=sys.stderr)
    files = load_model_files(Path(str(engine_args.model)))
    tokenizer = load_tokenizer(files, engine_args.tokenizer)
    vocab = files.config.get("vocab_size") or tokenizer.vocab_size
    special = tokenizer.special_token_ids() | set(tokenizer.eos_token_ids)
    vocab_ids = [t for t in range(min(vocab, tokenizer.vocab_size)) if t not in special]
    if args.dataset:
        bench = load_dataset(args.dataset, args.output_len, vocab_ids, args.num_prompts, seed=args.seed)
        workload = f"{len(bench)} prompts from {args.dataset}"
    else:
        n = args.num_prompts if args.num_prompts is not None else 100
        bench = synthetic_requests(n, args.input_len, args.output_len, vocab_ids, seed=args.seed)
        workload = f"{n} prompts x {args.input_len} random tokens, {args.output_len} output tokens each"
    if any(r.json_schema is not None for r in bench):
        raise ConfigError(f"{args.dataset}: json_schema lines are not supported with data parallelism")
    dp = dp_config_from_args(args, is_moe=False)
    device = engine_args.device
    threads = None
    if device in ("auto", "cpu") and engine_args.num_threads is None:
        # The ranks share this machine's cores rather than each claiming all.
        threads = max(1, (os.cpu_count() or 1) // dp.data_parallel_size)
    factory = TorchEngineFactory(engine_args, threads_per_rank=threads, default_kv_cache_memory=kv_default)
    print(f"model      {engine_args.model}" + (" (embedded demo model, RANDOM weights)" if embedded else ""))
    print(f"data       {describe_dp(dp)}")
    print(f"workload   {workload} (ignore_eos, all queued before the first step)")
    print()
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    local = args.data_parallel_size_local
    if local is not None and not 0 <= local <= dp.data_parallel_size:
        raise ConfigError(f"--data-parallel-size-local {local} must be in 0..{dp.data_parallel_size}")
    transport = ProcessTransport(
        factory,
        dp,
        backend=_backend(args.data_parallel_backend, device),
        host=args.data_parallel_address,
        master_port=args.data_parallel_rpc_port,
        collective_timeout_s=args.data_parallel_timeout,
        spawn_ranks=None if local is None else range(local),
        announce=lambda text: print(text, file=sys.stderr, flush=True),
    )
    engine = DPEngine(transport)
    collector, rejections, figures = _run(engine, bench, tokenizer)
    summary = collector[0].summary(collector[1], percentiles=percentiles)
    result = ThroughputResult(
        summary=summary,
        num_prompts=len(bench),
        num_steps=figures["steps"],
        num_busy_steps=figures["busy_steps"],
        num_preemptions=figures["preemptions"],
        prefix_cache_hit_rate=0.0,
        max_running=figures["max_running"],
        rejections=rejections,
        percentiles=percentiles,
    )
    print(result.table())
    s = result.summary
    print(
        f"Throughput: {s['request_throughput']:.2f} requests/s, "
        f"{s['total_token_throughput']:.2f} total tokens/s, {s['output_throughput']:.2f} output tokens/s"
    )
    print(f"Requests per rank: {'/'.join(str(n) for n in figures['per_rank'])}")
    for rid, why in rejections[:5]:
        print(f"failed {rid}: {why}")
    if args.result_json:
        data = result.to_json()
        data["model"] = str(engine_args.model)
        data["random_weights"] = embedded
        data["engine_args"] = dict(vars(engine_args))
        data["data_parallel"] = {
            "data_parallel_size": dp.data_parallel_size,
            "mode": "lockstep" if dp.lockstep else "independent",
            "balance_scheduling": dp.balance_scheduling,
            "prefill_schedule_interval": dp.prefill_schedule_interval,
            "requests_per_rank": figures["per_rank"],
        }
        with open(args.result_json, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {args.result_json}")
    return 1 if rejections else 0


def _run(
    engine: DPEngine, bench: list, tokenizer: object
) -> tuple[tuple[MetricsCollector, float], list[tuple[str, str]], dict]:
    """Queue everything, step until done; per-request timings as the outputs arrive."""
    start = time.monotonic()
    collector = MetricsCollector(origin=start)
    rejections: list[tuple[str, str]] = []
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itls: dict[str, list[float]] = {}
    prompt_lens: dict[str, int] = {}
    n = engine.num_ranks
    per_rank = [0] * n
    steps, busy, preemptions, running = [0] * n, [0] * n, [0] * n, [0] * n
    max_running = 0
    try:
        for i, r in enumerate(bench):
            rid = str(i)
            ids = r.prompt if isinstance(r.prompt, list) else tokenizer.encode(r.prompt)  # type: ignore[attr-defined]
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=1.0, top_p=1.0)
            rank = engine.add_request(Request(rid, ids, params, arrival_time=start))
            per_rank[rank] += 1
            prompt_lens[rid] = len(ids)
            itls[rid] = []
        while engine.has_unfinished_requests():
            for rep in engine.step():
                steps[rep.rank] += 1
                busy[rep.rank] += rep.executed
                running[rep.rank] = rep.num_running
                preemptions[rep.rank] = rep.num_preemptions
                for out in rep.outputs:
                    rid = out.request_id
                    n = len(out.new_token_ids)
                    if n:
                        if rid in last:
                            itls[rid].append(rep.time - last[rid])
                        else:
                            first[rid] = rep.time
                        itls[rid].extend([0.0] * (n - 1))
                        last[rid] = rep.time
                    if out.finish_reason is None:
                        continue
                    if out.error is not None or rid not in first:
                        why = out.error or f"finished without output ({out.finish_reason})"
                        rejections.append((rid, why))
                        collector.add_failed(prompt_lens[rid])
                    else:
                        res = engine.results[rid]
                        collector.add_request(
                            start, first[rid], rep.time, prompt_lens[rid], len(res.token_ids), itls[rid]
                        )
            max_running = max(max_running, sum(running))
    except DPRankError as e:
        for out in e.outputs:
            rejections.append((out.request_id, out.error or str(e)))
            collector.add_failed(prompt_lens.get(out.request_id, 0))
        print(f"error: {e}", file=sys.stderr)
    finally:
        engine.close()
    end = time.monotonic()
    # Lock-stepped ranks all count the group's steps; independent ones, their own.
    figures = {
        "steps": max(steps),
        "busy_steps": max(busy),
        "preemptions": sum(preemptions),
        "max_running": max_running,
        "per_rank": per_rank,
    }
    return (collector, end - start), rejections, figures
