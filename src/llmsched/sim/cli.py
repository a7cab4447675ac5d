"""`llmsched simulate`: what would this policy, budget or cache size do on that hardware?

Engine flags are named like vLLM's engine arguments and workload flags like
``vllm bench serve``'s; the summary and ``--result-json`` use vLLM's metric
names.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from llmsched.bench.metrics import parse_goodput, parse_percentiles
from llmsched.core.errors import ConfigError
from llmsched.core.kv.block_hash import HASH_ALGOS
from llmsched.engine.arg_types import positive_int
from llmsched.engine.dp.cli_args import add_dp_args, describe_dp, dp_config_from_args
from llmsched.engine.dp.router import SNAPSHOT_INTERVAL_S
from llmsched.engine.dp.sim_transport import DEFAULT_SYNC_S
from llmsched.engine.policy_args import add_policy_args
from llmsched.executor.sim.cost_model import Efficiency
from llmsched.executor.sim.hardware import known_hardware
from llmsched.executor.sim.model_shapes import known_models
from llmsched.sim.deployment import KV_CACHE_DTYPES, Deployment, DeploymentSpec, build_deployment
from llmsched.sim.frontend import (
    DEFAULT_CHUNK_SHARE,
    DEFAULT_OUTPUT_TOKEN_S,
    DEFAULT_REQUEST_S,
    DEFAULT_TOKEN_S,
    Frontend,
)
from llmsched.sim.pd import add_pd_args, pd_from_args
from llmsched.sim.runner import simulate
from llmsched.sim.workload import Workload, load_trace_workload, synthetic_workload


def add_simulate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `simulate` subcommand on ``sub``."""
    p = sub.add_parser(
        "simulate",
        help="simulate serving a workload on given hardware with the real scheduler and a cost model",
        description="Run a workload through the real scheduler and engine loop with the model replaced "
        "by a roofline cost model on a virtual clock, and report vLLM-style serving metrics.",
    )
    e = p.add_argument_group("deployment (vLLM engine arguments)")
    e.add_argument(
        "--model",
        default="llama-3-8b",
        help=f"built-in profile ({', '.join(known_models())}) or a path to a Hugging Face "
        "config.json / model folder (default llama-3-8b)",
    )
    e.add_argument(
        "--hardware",
        default="h100",
        help=f"{', '.join(known_hardware())} (cpu is calibrated on this machine), or a JSON "
        "profile: a file `llmsched calibrate` wrote, or HardwareProfile fields (default h100)",
    )
    e.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=None,
        help="GPUs per engine rank (default 1; with --data-parallel-size: the smallest that fits)",
    )
    e.add_argument(
        "--enable-expert-parallel", action="store_true", help="spread MoE experts over the TP group"
    )
    d = add_dp_args(p, real=False)
    d.add_argument(
        "--dp-sync-ms",
        type=float,
        default=DEFAULT_SYNC_S * 1e3,
        help=f"cost of the ranks' per-step exchange ({DEFAULT_SYNC_S * 1e3:g} ms)",
    )
    e.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    e.add_argument("--max-num-seqs", type=positive_int, default=None)
    e.add_argument("--max-model-len", type=positive_int, default=None)
    e.add_argument("--block-size", type=positive_int, default=16)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--long-prefill-token-threshold", type=int, default=0)
    add_policy_args(e)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument(
        "--num-gpu-blocks",
        "--num-gpu-blocks-override",
        dest="num_gpu_blocks",
        type=positive_int,
        default=None,
        help="KV cache blocks (null block included) instead of sizing from memory",
    )
    e.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto")
    e.add_argument("--quantization", "-q", choices=["fp8"], default=None)
    e.add_argument("--prefix-caching-hash-algo", choices=["auto", *HASH_ALGOS], default="auto")
    e.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan each step while the previous one runs on the model, as vLLM's AsyncScheduler "
        "(default: on, as vLLM 0.33); the simulator then overlaps each step's host path with the "
        "other step's model time. With --data-parallel-size > 1 only sync is simulated (the default there)",
    )
    lo = p.add_argument_group("LoRA")
    lo.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="serve the workload's lora_id adapters, at most N per step (the scheduler's slot rule); "
        "their products are priced. Default: LoRA off, lora_id ignored",
    )
    lo.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        metavar="R",
        help="rank the adapter products are priced at (default 16, as vLLM)",
    )
    sp = p.add_argument_group("speculative decoding")
    sp.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="vLLM's speculative config plus an acceptance model, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "acceptance_rate": 0.7}\' or '
        '\'{"model": "llama-3.2-1b", "num_speculative_tokens": 4, "acceptance_rates": [0.8, 0.6, 0.4]}\' '
        "(a draft model is a model shape priced on the same hardware; acceptance rates are per draft "
        'token, given all earlier ones were accepted; "seed" makes the draws reproduce)',
    )
    sp.add_argument(
        "--spec-acceptance",
        default=None,
        metavar="RATE[,RATE...]",
        help="acceptance rate per draft token (one for all positions, or one per position); "
        "overrides the --speculative-config JSON's",
    )
    c = p.add_argument_group("cost model")
    c.add_argument(
        "--efficiency",
        action="append",
        metavar="KEY=VALUE",
        help="override efficiencies, e.g. gemm=0.6,memory=0.75 (keys: gemm, attention, memory, network)",
    )
    c.add_argument(
        "--step-overhead-ms",
        type=float,
        default=None,
        help="fixed cost per engine step (default: the hardware's measured one, else 0.5)",
    )
    c.add_argument(
        "--cuda-graph-max-tokens",
        "--max-cudagraph-capture-size",
        dest="cuda_graph_max_tokens",
        type=int,
        default=None,
        metavar="N",
        help="largest step replayed from a CUDA graph (default as vLLM: 2 x max_num_seqs, at most 512); "
        "0 launches every step's kernels eagerly",
    )
    c.add_argument(
        "--launch-latency-us",
        type=float,
        default=None,
        help="host time per kernel launched outside a CUDA graph (default: the hardware's, 5 on GPUs)",
    )
    c.add_argument(
        "--kernels-per-layer",
        type=float,
        default=None,
        help="kernels one decoder layer launches eagerly (default: counted from the model's modules)",
    )
    c.add_argument("--recalibrate", action="store_true", help="re-measure the cpu profile")
    w = p.add_argument_group("workload (vLLM benchmark arguments)")
    w.add_argument(
        "--num-prompts", type=positive_int, default=None, help="requests (default 1000; a trace: all of it)"
    )
    w.add_argument("--input-len", "--random-input-len", dest="input_len", type=positive_int, default=1024)
    w.add_argument("--output-len", "--random-output-len", dest="output_len", type=positive_int, default=128)
    w.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (0: fixed)",
    )
    w.add_argument(
        "--prefix-len",
        "--random-prefix-len",
        dest="prefix_len",
        type=int,
        default=0,
        help="shared prefix tokens prepended to every prompt of a group",
    )
    w.add_argument("--num-prefix-groups", type=positive_int, default=1)
    w.add_argument(
        "--images-per-request",
        type=int,
        default=0,
        help="vision-language workloads: images in every prompt (0: text only), priced with --vision-encoder",
    )
    w.add_argument("--image-tokens", type=positive_int, default=576, help="embeddings per image (mean)")
    w.add_argument(
        "--image-tokens-range-ratio", type=float, default=0.0, help="image sizes uniform in tokens*(1 +- r)"
    )
    w.add_argument(
        "--image-repeat", type=float, default=0.0, help="share of images that repeat an earlier one (0-1)"
    )
    w.add_argument(
        "--vision-encoder",
        default="clip-vit-l-336",
        help="the ViT priced per scheduled image: clip-vit-l-336 (LLaVA-1.5) or clip-vit-b-224",
    )
    w.add_argument("--num-priority-levels", type=positive_int, default=1, help="random priorities 0..N-1")
    w.add_argument(
        "--num-loras",
        type=int,
        default=0,
        metavar="K",
        help="request i runs LoRA adapter i %% K + 1 (default 0: none); with --max-loras",
    )
    w.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson unless --burstiness says otherwise (inf: all at once)",
    )
    w.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier, inf a fixed interval",
    )
    w.add_argument("--max-concurrency", type=positive_int, default=None, help="closed-loop client slots")
    w.add_argument(
        "--dataset",
        "--dataset-path",
        dest="dataset",
        metavar="FILE.jsonl",
        help="trace: one JSON object per line with arrival_time, prompt_len or prompt_token_ids, output_len",
    )
    w.add_argument("--seed", type=int, default=0)
    se = p.add_argument_group("multi-turn sessions")
    se.add_argument(
        "--sessions",
        type=positive_int,
        default=None,
        metavar="N",
        help="simulate N multi-turn conversations instead of --num-prompts requests: first prompt "
        "--input-len, then --turn-input-len new tokens per turn, --output-len out per turn; first turns "
        "arrive at --request-rate; prints TTFT per turn",
    )
    se.add_argument("--turns", type=positive_int, default=4, help="turns per conversation (default 4)")
    se.add_argument("--turn-input-len", type=positive_int, default=128, help="new tokens per later turn")
    se.add_argument(
        "--think-time",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between a turn's last token and the next turn's input (mean; default 2)",
    )
    se.add_argument("--think-time-dist", choices=["fixed", "exponential"], default="fixed")
    se.add_argument(
        "--session-mode",
        choices=["session", "resend"],
        default="session",
        help="session: resumable requests keeping their KV between turns (default); resend: each turn "
        "a new request with the whole history",
    )
    o = p.add_argument_group("output")
    o.add_argument("--result-json", "--result-filename", dest="result_json", metavar="PATH")
    o.add_argument("--save-detailed", action="store_true", help="per-request lists in --result-json")
    o.add_argument(
        "--trace", metavar="OUT.jsonl", help="write the step trace (replay format + simulated time)"
    )
    o.add_argument("--explain", action="store_true", help="record why each request did or did not run")
    o.add_argument("--plot", metavar="PREFIX", help="write PREFIX_timeline.png, PREFIX_tokens.png, ...")
    o.add_argument("--disable-tqdm", action="store_true")
    o.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs as in vLLM, e.g. ttft:300 tpot:50")
    o.add_argument("--goodput-ttft-ms", type=float, default=None)
    o.add_argument("--goodput-tpot-ms", type=float, default=None)
    o.add_argument("--goodput-e2el-ms", type=float, default=None)
    o.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated (default 50,90,99)")
    f = p.add_argument_group("frontend")
    f.add_argument(
        "--api-server-count",
        type=positive_int,
        default=None,
        help="model N API servers in front of each engine core (vLLM's flag): each tokenizes and passes on "
        "one request at a time, so requests reach the engine over time and it starts stepping as soon as it "
        "has work, and streams every output token back, in one queue with the requests, so clients see "
        "tokens when their server has sent them; the trace's in_frontend counts requests still on the way "
        "in; with data-parallel ranks each "
        f"server routes its requests as vLLM's do, from {SNAPSHOT_INTERVAL_S * 1e3:g} ms snapshots of the "
        "ranks' queues (default: none, every request reaches the engine when sent, as llmsched's offline "
        "path queues a batch)",
    )
    measured = "vLLM's own API server, measured on a 2-core AMD EPYC by benchmarks/serving/api_server_cost.py"
    f.add_argument(
        "--api-server-us-per-request",
        type=float,
        default=DEFAULT_REQUEST_S * 1e6,
        help=f"an API server's fixed work per request (default {DEFAULT_REQUEST_S * 1e6:g}: {measured})",
    )
    f.add_argument(
        "--api-server-us-per-token",
        type=float,
        default=DEFAULT_TOKEN_S * 1e6,
        help=f"an API server's work per prompt token (default {DEFAULT_TOKEN_S * 1e6:g}: {measured})",
    )
    f.add_argument(
        "--api-server-us-per-output-token",
        type=float,
        default=DEFAULT_OUTPUT_TOKEN_S * 1e6,
        help=f"an API server's work per streamed output token (default {DEFAULT_OUTPUT_TOKEN_S * 1e6:g}: "
        f"{measured}; 0: requests only, the output costs the server nothing)",
    )
    f.add_argument(
        "--api-server-us-per-chunk",
        type=float,
        default=None,
        help="the part of --api-server-us-per-output-token paid per SSE chunk, not per token: a server "
        "that falls behind merges a stream's queued tokens into one chunk (default "
        f"{100 * DEFAULT_CHUNK_SHARE:.0f}%% of it: {measured}, streamed against answered whole)",
    )
    sw = p.add_argument_group("sweeps")
    sw.add_argument(
        "--sweep",
        metavar="SWEEP.yaml",
        help="simulate every configuration of a sweep file (grid or random search over DeploymentSpec "
        "knobs: tensor/data parallel size, max_num_seqs, max_num_batched_tokens, policy, hardware) and "
        "report each point, the Pareto front of throughput per GPU vs p99 TTFT, and the cheapest "
        "configuration meeting the file's SLO; the other deployment and workload flags are ignored",
    )
    sw.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="run the sweep's points as Ray tasks on this cluster (auto, HOST:PORT, ray://HOST:PORT, "
        "or local to start one here); default: a local process pool",
    )
    sw.add_argument(
        "--sweep-workers", type=positive_int, default=None, help="process-pool size (default: CPU count)"
    )
    add_pd_args(p)
    p.set_defaults(func=run_simulate)
    return p


def run_sweep_cli(args: argparse.Namespace) -> int:
    """--sweep: simulate the file's points, print the table, write JSON and the plot."""
    import time

    from llmsched.sim.sweep import load_sweep, run_sweep
    from llmsched.sim.sweep_report import format_table, sweep_json, write_sweep_plot

    sweep = load_sweep(args.sweep)
    backend = f"ray ({args.ray_address})" if args.ray_address else "process pool"
    print(
        f"sweep      {len(sweep.points)} points on a {backend}; SLO p99 TTFT <= {sweep.slo_p99_ttft_ms:g} ms"
    )
    t0 = time.perf_counter()
    rows = run_sweep(sweep, workers=args.sweep_workers, ray_address=args.ray_address)
    wall = time.perf_counter() - t0
    print(format_table(rows, sweep))
    print(f"Swept {len(rows)} points in {wall:.1f} s wall")
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.result_json, "w") as f:
            json.dump(sweep_json(rows, sweep, wall, backend), f, indent=2)
        print(f"wrote {args.result_json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {write_sweep_plot(rows, sweep, f'{args.plot}_sweep.png')}")
    return 0


def _workload(args: argparse.Namespace) -> Workload:
    if args.dataset:
        return load_trace_workload(
            args.dataset,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            seed=args.seed,
            num_prompts=args.num_prompts,
        )
    return synthetic_workload(
        args.num_prompts if args.num_prompts is not None else 1000,
        args.input_len,
        args.output_len,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_prefix_groups=args.num_prefix_groups,
        num_priority_levels=args.num_priority_levels,
        num_loras=args.num_loras,
        seed=args.seed,
        images_per_request=args.images_per_request,
        image_tokens=args.image_tokens,
        image_range_ratio=args.image_tokens_range_ratio,
        image_repeat=args.image_repeat,
    )


def run_simulate(args: argparse.Namespace) -> int:
    """Build the deployment and workload, simulate, print and write the results."""
    if args.sweep:
        return run_sweep_cli(args)
    if args.ray_address:
        raise ConfigError("--ray-address runs a sweep's points: give --sweep SWEEP.yaml too")
    slos = parse_goodput(args.goodput)
    for key in ("ttft", "tpot", "e2el"):
        v = getattr(args, f"goodput_{key}_ms")
        if v is not None:
            slos[key] = v
    percentiles = parse_percentiles(args.metric_percentiles)
    dp_size = args.data_parallel_size
    tp = args.tensor_parallel_size if args.tensor_parallel_size is not None or dp_size > 1 else 1
    if args.balance_scheduling and dp_size == 1:
        raise ConfigError("--balance-scheduling balances data-parallel ranks: set --data-parallel-size > 1")
    # None resolves as vLLM 0.33 does (on), except for the data-parallel
    # simulation, which models sync ranks only.
    async_scheduling = args.async_scheduling if args.async_scheduling is not None else dp_size == 1
    spec = DeploymentSpec(
        model=args.model,
        hardware=args.hardware,
        tensor_parallel_size=tp,
        enable_expert_parallel=args.enable_expert_parallel,
        data_parallel_size=dp_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy,
        policy_config=args.policy_config,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        efficiency=Efficiency.overrides(args.efficiency),
        step_overhead_ms=args.step_overhead_ms,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        launch_latency_us=args.launch_latency_us,
        kernels_per_layer=args.kernels_per_layer,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        async_scheduling=async_scheduling,
        recalibrate=args.recalibrate,
        speculative_config=args.speculative_config,
        spec_acceptance=args.spec_acceptance,
    )
    deployment = build_deployment(spec)
    dp = None
    if dp_size > 1:
        dp = dp_config_from_args(args, deployment.model.is_moe)
    elif args.prefill_schedule_interval > 1:
        deployment.scheduler_config = replace(
            deployment.scheduler_config, prefill_schedule_interval=args.prefill_schedule_interval
        )
    if args.dp_sync_ms < 0:
        raise ConfigError(f"--dp-sync-ms {args.dp_sync_ms} must be >= 0")
    if args.sessions is not None:
        return _run_sessions(args, deployment)
    workload = _workload(args)
    pd = pd_from_args(args)
    if pd is not None:
        if deployment.spec_decode is not None:
            raise ConfigError("speculative decoding is simulated for a single engine, not with P/D")
        return _run_pd(args, deployment, workload, pd, slos, percentiles)
    frontend = None
    if args.api_server_count is not None:
        frontend = Frontend(
            args.api_server_count,
            args.api_server_us_per_token / 1e6,
            args.api_server_us_per_request / 1e6,
            args.api_server_us_per_output_token / 1e6,
            None if args.api_server_us_per_chunk is None else args.api_server_us_per_chunk / 1e6,
        )
    # Output folders are made up front so a long run cannot fail at the end.
    for path in (args.result_json, args.trace, args.plot):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    for line in deployment.describe():
        print(line)
    if dp is not None:
        if frontend is not None:
            routing = f"routed by the API servers from {SNAPSHOT_INTERVAL_S * 1e3:g} ms snapshots"
            print(f"data       {describe_dp(dp, routing)}")
        else:
            print(f"data       {describe_dp(dp)}")
    print(f"workload   {workload.describe()}")
    if frontend is not None:
        print(f"frontend   {frontend.describe()}")
    print()
    trace = open(args.trace, "w") if args.trace else None  # noqa: SIM115
    try:
        kwargs = {
            "max_concurrency": args.max_concurrency,
            "goodput_slos_ms": slos or None,
            "percentiles": percentiles,
            "trace_out": trace,
            "explain": args.explain,
            "record_series": bool(args.plot),
            "progress": not args.disable_tqdm,
            "detailed": args.save_detailed,
        }
        vision = None
        if workload.images is not None:
            from llmsched.executor.sim.vision_cost import VisionCost, vision_shape

            cm = deployment.cost_model
            vision = VisionCost(vision_shape(args.vision_encoder), deployment.hardware, cm.efficiency)
        result = simulate(
            deployment,
            workload,
            dp=dp,
            sync_s=args.dp_sync_ms / 1e3,
            frontend=frontend,
            vision=vision,
            **kwargs,
        )
    finally:
        if trace is not None:
            trace.close()
    print(result.table())
    for rid, why in result.rejections[:5]:
        print(f"rejected {rid}: {why}")
    if args.result_json:
        data = result.to_json()
        data["goodput_slos_ms"] = slos or None
        with open(args.result_json, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {args.result_json}")
    if args.trace:
        print(f"wrote {args.trace}")
    if args.plot:
        from llmsched.sim.plots import write_plots

        for path in write_plots(result, args.plot):
            print(f"wrote {path}")
    return 0


def _run_sessions(args: argparse.Namespace, deployment: Deployment) -> int:
    """``--sessions``: multi-turn conversations with think times; per-turn figures."""
    from llmsched.sim.sessions import SessionWorkload, simulate_sessions

    wl = SessionWorkload(
        num_sessions=args.sessions,
        turns=args.turns,
        first_input_len=args.input_len,
        input_len=args.turn_input_len,
        output_len=args.output_len,
        think_time_s=args.think_time,
        think_dist=args.think_time_dist,
        session_rate=args.request_rate,
        seed=args.seed,
    )
    for line in deployment.describe():
        print(line)
    print(f"workload   {wl.describe()}, served as {args.session_mode}\n")
    result = simulate_sessions(deployment, wl, args.session_mode)
    print(result.table())
    for rid, why in result.rejections[:5]:
        print(f"rejected {rid}: {why}")
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        data = {"workload": wl.describe(), **result.summary(), "deployment": deployment.to_dict()}
        if args.save_detailed:
            data.update(result.per_turn_lists())
        Path(args.result_json).write_text(json.dumps(data, indent=2))
        print(f"wrote {args.result_json}")
    return 0


def _run_pd(args: argparse.Namespace, deployment, workload: Workload, pd, slos: dict, percentiles) -> int:
    """--pd: prefill and decode instances (see llmsched.sim.pd)."""
    from llmsched.sim.pd import format_pd, simulate_pd

    if deployment.data_parallel_size != 1:
        raise ConfigError("--pd sets the instances: drop --data-parallel-size")
    unsupported = {
        "--trace": args.trace, "--plot": args.plot, "--explain": args.explain,
        "--max-concurrency": args.max_concurrency, "--api-server-count": args.api_server_count,
    }  # fmt: skip
    given = [flag for flag, v in unsupported.items() if v]
    if given:
        raise ConfigError(f"--pd runs without {', '.join(given)}: drop them")
    for line in deployment.describe():
        print(line.replace("hardware  ", "instance  ", 1))
    print(f"workload   {workload.describe()}\n")
    result = simulate_pd(deployment, workload, pd, slos or None, percentiles, detailed=args.save_detailed)
    print(format_pd(result))
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.result_json, "w") as f:
            json.dump({**result.to_dict(), "goodput_slos_ms": slos or None}, f, indent=2)
        print(f"wrote {args.result_json}")
    return 0
