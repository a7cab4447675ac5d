#!/usr/bin/env python3
"""What the HTTP layer costs the engine: steps/s with streaming clients vs the same work in-process.

Workload: --clients requests (default 100) of --input-len random prompt
tokens and --output-len output tokens each (ignore_eos, temperature 1), the
embedded demo model unless --model is given.

- in-process: the requests are added to an LLMEngine (DELTA outputs, the
  decision trace on, as the server runs it) and stepped to the end on a
  worker thread, as the server's engine loop steps;
- server: `llmsched serve` (engine in its own process, the default) and
  `llmsched bench serve` (a separate client process, niced; --client-nice 0
  to compare without) streams the same requests, all at once.

The figure of merit is engine steps per second while all requests run
(the decode steady state: every step serves every client), from the
engine's own step timestamps (GET /debug/steps for the server). Whole-run
step rates, streamed output tokens/s, and the engine's CPU time per step
(which, unlike wall time, other load on the machine does not inflate) are
reported too. Two CPU layouts: "pinned" gives the engine half the CPUs and
the HTTP server and client the other half (how one deploys on a small
box); "shared" pins nothing. Torch threads: the server's default for the
model (every usable CPU, one fewer for a small model such as the embedded
one) or the engine's CPUs when pinned, the same for both sides.
Repeats alternate in-process and server runs; medians are reported.

    python benchmarks/serving/server_overhead.py [--json results/server_overhead.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched.bench.serve import RANDOM_PROMPT_IDS  # noqa: E402
from llmsched.bench.throughput import synthetic_requests  # noqa: E402
from llmsched.core.sampling_params import SamplingParams  # noqa: E402
from llmsched.engine.args import EngineArgs  # noqa: E402
from llmsched.engine.llm_engine import LLMEngine  # noqa: E402
from llmsched.engine.model_files import load_model_files  # noqa: E402
from llmsched.engine.outputs import RequestOutputKind  # noqa: E402
from llmsched.engine.serve_threads import serving_threads  # noqa: E402
from llmsched.executor.torch.embedded import ensure_embedded_model  # noqa: E402

TARGET = 0.80


def rates(steps: list[tuple[float, float, int, float]], num_clients: int) -> dict:
    """Step rates from (end time, duration s, running, engine CPU s) per step: steady and whole run."""
    busy = [s for s in steps if s[2] > 0]
    steady = [s for s in busy if s[2] >= num_clients]
    out = {"num_steps": len(busy), "num_steady_steps": len(steady)}
    if len(busy) >= 2:
        span = busy[-1][0] - (busy[0][0] - busy[0][1])
        out["steps_per_s"] = len(busy) / span
    if len(steady) >= 3:
        out["steady_steps_per_s"] = (len(steady) - 1) / (steady[-1][0] - steady[0][0])
        # Where a steady step's time goes: inside engine.step(), or between steps.
        out["steady_step_ms"] = statistics.median(s[1] for s in steady) * 1000
        gaps = [(b[0] - b[1] - a[0]) * 1000 for a, b in itertools.pairwise(steady)]
        out["steady_gap_ms"] = statistics.median(gaps)
        # CPU the engine spent per step: what the work costs, whatever else the machine runs.
        out["steady_step_cpu_ms"] = statistics.median(s[3] for s in steady) * 1000
    return out


def run_in_process(engine: LLMEngine, requests: list, tag: str, engine_cpus: set[int] | None = None) -> dict:
    """Add every request at once and step to the end, on a thread of its own as the server steps.

    The thread matters: on a busy machine torch's CPU kernels run several
    times slower called from the main thread than from another one, which
    would flatter the server.
    """
    result: list[dict] = []

    def work() -> None:
        if engine_cpus:
            # This thread and the torch executor's own (the model runs there).
            os.sched_setaffinity(0, engine_cpus)
            for t in threading.enumerate():
                if t.name.startswith("llmsched-executor") and t.native_id is not None:
                    os.sched_setaffinity(t.native_id, engine_cpus)
        result.append(_run_in_process(engine, requests, tag))

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return result[0]


def _run_in_process(engine: LLMEngine, requests: list, tag: str) -> dict:
    engine.scheduler.enable_trace()
    t0 = time.time()
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=1.0, top_p=1.0)
        engine.add_request(
            f"{tag}-{i}", {"prompt_token_ids": r.prompt}, params, output_kind=RequestOutputKind.DELTA
        )
    steps: list[tuple[float, float, int, float]] = []
    tokens = 0
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        c0 = time.thread_time()
        outs = engine.step()
        cpu = time.thread_time() - c0
        dt = time.perf_counter() - s0
        es = engine.last_step
        if es is not None:  # None: a call that only put a step in flight (async scheduling)
            steps.append((time.time(), dt, es.num_running, cpu))
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.time() - t0
    out = rates(steps, len(requests))
    out.update(output_tokens=tokens, output_tokens_per_s=tokens / wall, wall_s=wall)
    return out


def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process to ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        # A thread may end between the listing and the call.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def split_cpus(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(engine CPUs, HTTP + client CPUs): half the machine each when pinning, else no pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    k = max(1, len(cpus) // 2)
    return set(cpus[:k]), set(cpus[k:])


def start_server(engine_flags: list[str]) -> tuple[subprocess.Popen, str]:
    """`llmsched serve` on a free port; returns the process and its base URL."""
    cmd = [sys.executable, "-m", "llmsched.cli", "serve", "--port", "0", "--log-level", "warning"]
    cmd += ["--trace-steps", "8192", *engine_flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    url = None
    deadline = time.monotonic() + 120
    for line in proc.stderr:  # type: ignore[union-attr]
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            url = m.group(1)
            break
        if time.monotonic() > deadline:
            break
    if url is None:
        proc.kill()
        raise RuntimeError("the server did not start")
    # Keep draining stderr so the server never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    for _ in range(300):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    return proc, url


def run_server(url: str, args: argparse.Namespace, client_cpus: set[int] | None = None) -> dict:
    """Stream the workload through `llmsched bench serve`; engine step rates from the server's trace."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "serve.json"
        cmd = ["nice", "-n", str(args.client_nice)] if args.client_nice else []
        cmd += [sys.executable, "-m", "llmsched.cli", "bench", "serve", "--base-url", url]
        cmd += ["--num-prompts", str(args.clients), "--max-concurrency", str(args.clients)]
        cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        cmd += ["--seed", str(args.seed), "--disable-tqdm", "--result-json", str(result)]
        t0 = time.time()
        pin = (lambda: os.sched_setaffinity(0, client_cpus)) if client_cpus else None
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800, preexec_fn=pin)
        t1 = time.time()
        client = json.loads(result.read_text())
    records = httpx.get(url + "/debug/steps", params={"last": 8192}, timeout=60).json()["steps"]
    steps = [
        (r["time"], (r["duration_ms"] or 0.0) / 1000, r["num_running"], (r["cpu_ms"] or 0.0) / 1000)
        for r in records
        if t0 <= r["time"] <= t1
    ]
    out = rates(steps, args.clients)
    out.update(
        output_tokens=client["total_output_tokens"],
        output_tokens_per_s=client["output_throughput"],
        completed=client["completed"],
        failed=client["failed"],
        mean_ttft_ms=client["mean_ttft_ms"],
        mean_itl_ms=client["mean_itl_ms"],
        p99_itl_ms=client["p99_itl_ms"],
        wall_s=client["duration"],
    )
    return out


def median(runs: list[dict], key: str) -> float | None:
    """Median of a figure over the runs that have it."""
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def measure(args: argparse.Namespace, pin: bool) -> dict:
    """One configuration: a fresh server and in-process engine, alternating repeats; medians."""
    engine_cpus, other_cpus = split_cpus(pin)
    # The server's default for the model unless pinned or told; the in-process engine runs the same.
    default = serving_threads(load_model_files(args.model or ensure_embedded_model()).config)
    threads = args.num_threads or (len(engine_cpus) if engine_cpus else default)
    blocks = args.clients * (-(-(args.input_len + args.output_len) // 16)) + 64
    max_len = args.input_len + args.output_len + 16
    engine_flags = ["--num-gpu-blocks", str(blocks), "--max-model-len", str(max_len)]
    if args.model:
        engine_flags += ["--model", args.model]
    if threads:
        engine_flags += ["--num-threads", str(threads)]
    engine_args = EngineArgs(
        model=args.model, num_gpu_blocks_override=blocks, max_model_len=max_len, num_threads=threads
    )
    requests = synthetic_requests(
        args.clients, args.input_len, args.output_len, list(RANDOM_PROMPT_IDS), args.seed
    )
    engine = LLMEngine(engine_args)
    proc, url = start_server(engine_flags)
    if engine_cpus:
        pin_process(proc.pid, other_cpus)  # type: ignore[arg-type]
        for child in child_pids(proc.pid):
            pin_process(child, engine_cpus)
    inproc: list[dict] = []
    served: list[dict] = []
    name = "pinned" if engine_cpus else "shared"
    try:
        # One unmeasured round each: first-call costs (allocator, caches) out of the figures.
        run_in_process(engine, requests[: min(8, len(requests))], "warm", engine_cpus)
        run_server(url, argparse.Namespace(**{**vars(args), "clients": min(8, args.clients)}), other_cpus)
        for rep in range(args.repeats):
            inproc.append(run_in_process(engine, requests, f"r{rep}", engine_cpus))
            served.append(run_server(url, args, other_cpus))
            print(
                f"[{name}] repeat {rep + 1}/{args.repeats}: in-process "
                f"{inproc[-1].get('steady_steps_per_s', 0):.1f} steps/s, server "
                f"{served[-1].get('steady_steps_per_s', 0):.1f} steps/s (all {args.clients} running)",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(30)
        engine.close()
    summary: dict = {
        "cpus": {
            "engine": sorted(engine_cpus) if engine_cpus else "all",
            "http_and_client": sorted(other_cpus) if other_cpus else "all",
        },
        "num_threads": threads,
    }
    for key in (
        "steady_steps_per_s", "steps_per_s", "output_tokens_per_s", "num_steps", "wall_s", "steady_step_ms",
        "steady_gap_ms", "steady_step_cpu_ms",
    ):  # fmt: skip
        summary[f"in_process_{key}"] = median(inproc, key)
        summary[f"server_{key}"] = median(served, key)
    for key in ("mean_ttft_ms", "mean_itl_ms", "p99_itl_ms"):
        summary[f"server_{key}"] = median(served, key)
    summary["steady_ratio"] = (summary["server_steady_steps_per_s"] or 0) / (
        summary["in_process_steady_steps_per_s"] or 1
    )
    summary["whole_run_ratio"] = (summary["server_steps_per_s"] or 0) / (
        summary["in_process_steps_per_s"] or 1
    )
    summary["meets_target"] = summary["steady_ratio"] >= TARGET
    summary["in_process_runs"] = inproc
    summary["server_runs"] = served
    return summary


def report(name: str, s: dict) -> None:
    """Print one configuration's table."""
    cpus = s["cpus"]
    print(f"\n{name}: engine on CPUs {cpus['engine']}, HTTP server and client on {cpus['http_and_client']}")
    print(f"{'':28}{'in-process':>12}{'server':>12}{'ratio':>8}")
    for label, key in (
        ("steps/s, all running", "steady_steps_per_s"),
        ("steps/s, whole run", "steps_per_s"),
        ("output tokens/s", "output_tokens_per_s"),
        ("engine steps", "num_steps"),
        ("ms in a steady step", "steady_step_ms"),
        ("ms between steady steps", "steady_gap_ms"),
        ("engine CPU ms per steady step", "steady_step_cpu_ms"),
    ):
        a, b = s[f"in_process_{key}"] or 0, s[f"server_{key}"] or 0
        print(f"{label:<28}{a:>12.1f}{b:>12.1f}{(b / a if a else 0):>8.2f}")
    print(
        f"server, as clients saw it: TTFT {s['server_mean_ttft_ms']:.1f} ms, ITL mean "
        f"{s['server_mean_itl_ms']:.1f} ms / p99 {s['server_p99_itl_ms']:.1f} ms"
    )
    verdict = "MET" if s["meets_target"] else "NOT MET"
    print(f"target: server >= {TARGET:.0%} of in-process steps/s: {verdict} ({s['steady_ratio']:.0%})")


def main() -> int:
    """Run the comparison (pinned and shared CPUs), print it, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model folder (default: the embedded demo model)")
    p.add_argument("--client-nice", type=int, default=10, help="niceness of the client process (0: none)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads of both engines")
    p.add_argument(
        "--configs",
        default="pinned,shared",
        help="pinned: the engine on half the CPUs, HTTP server and client on the rest; shared: no pinning",
    )
    p.add_argument("--json", default=str(ROOT / "results" / "server_overhead.json"))
    args = p.parse_args()

    results = {}
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        if name not in ("pinned", "shared"):
            p.error(f"unknown config {name!r}")
        results[name] = measure(args, pin=name == "pinned")
    what = f"{args.clients} streaming clients x {args.input_len} prompt + {args.output_len} output tokens"
    print(f"\nworkload: {what}")
    for name, s in results.items():
        report(name, s)
    data = {
        "benchmark": "server_overhead",
        "workload": {
            "clients": args.clients,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "model": args.model or "embedded",
            "client_nice": args.client_nice,
        },
        "machine": {"cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        "target": TARGET,
        "configs": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record_cpu(data), indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
