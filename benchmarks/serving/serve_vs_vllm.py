#!/usr/bin/env python3
"""`llmsched serve` against `vllm serve` on the same model folder, driven by one client.

Each server starts in turn (its own defaults; only --max-model-len is given
to both), waits for /health, and is driven by the same client and the same
dataset seeds: random prompts of --input-len tokens and --output-len output
tokens each (ignore_eos), --num-prompts per run, first all at once (the
burst, which also measures each server's capacity in requests/s), then
Poisson arrivals at --load-fractions of the lower of the two capacities
(30/60/90/110% by default; --rates gives absolute rates instead). Every
load runs --repeats times with a fresh dataset seed per load and repeat,
the same seeds for both servers.

The client is `llmsched bench serve` (default) or vLLM's own `vllm bench
serve` (--client vllm, needs --vllm-python). vLLM's server needs
--vllm-python (a Python with vLLM installed); without it the vLLM side is
skipped and says so.

The headline is equal cores: vLLM's engine is bound to every usable core
(`VLLM_CPU_OMP_THREADS_BIND=0-N`), llmsched runs its defaults on the same
cores. `--vllm-omp-bind auto` gives vLLM its own serve default (its engine
on every core but one, the last left to its API server) as a side run.
The JSON names each engine's configuration and the processor.

    python benchmarks/serving/serve_vs_vllm.py --model DIR --vllm-python VENV/bin/python \\
        --vllm-cli vllm_cli.py --json results/serve_vs_vllm.json --plot results/serve_vs_vllm.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("ttft", "tpot", "itl")
SUMMARY_KEYS = (
    "output_throughput",
    "request_throughput",
    *(f"{s}_{m}_ms" for m in METRICS for s in ("median", "p99")),
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llmsched_cmd(args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """`llmsched serve` with its defaults on the model folder."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "llmsched.cli", "serve", args.model, "--port", str(port)]
    cmd += ["--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    if args.llmsched_threads:
        cmd += ["--num-threads", str(args.llmsched_threads)]
    if args.data_parallel_size > 1:
        cmd += ["--data-parallel-size", str(args.data_parallel_size)]
    return cmd, env


def llmsched_configuration(args: argparse.Namespace) -> dict:
    """What `llmsched serve` ran: its data-parallel ranks and torch threads (recorded in the JSON)."""
    return {
        "data_parallel_size": args.data_parallel_size,
        "num_threads": args.llmsched_threads,
        "command": "llmsched " + " ".join(llmsched_cmd(args, 0)[0][3:]).replace(" --port 0", ""),
    }


def vllm_env(args: argparse.Namespace) -> dict:
    """vLLM's CPU environment: tcmalloc and Intel OpenMP preloaded, as its CPU docs advise."""
    venv = Path(args.vllm_python).resolve().parents[1]
    preload = [
        p
        for p in (
            venv / "sys/root/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            venv / "lib/libiomp5.so",
        )
        if p.exists()
    ]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    env.update(VLLM_CPU_OMP_THREADS_BIND=args.vllm_omp_bind, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("PYTHONPATH", None)
    if preload:
        env["LD_PRELOAD"] = ":".join(map(str, preload))
    return env


def vllm_configuration(args: argparse.Namespace) -> dict:
    """What `vllm serve` ran: its thread binding and KV space (recorded in the JSON)."""
    return {
        "omp_threads_bind": args.vllm_omp_bind,
        "kv_cache_space_gib": args.vllm_kv_gib,
        "command": "vllm serve MODEL --dtype bfloat16 --max-model-len " + str(args.max_model_len),
    }


def all_cores() -> str:
    """Every usable core as a VLLM_CPU_OMP_THREADS_BIND range list, e.g. ``0-1``."""
    cores = sorted(os.sched_getaffinity(0))
    ranges: list[str] = []
    start = prev = cores[0]
    for c in [*cores[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}-{prev}" if prev > start else str(start))
        if c is not None:
            start = prev = c
    return ",".join(ranges)


def vllm_cli(args: argparse.Namespace) -> list[str]:
    """How to run vLLM's CLI with --vllm-python."""
    if args.vllm_cli:
        return [args.vllm_python, args.vllm_cli]
    return [args.vllm_python, "-m", "vllm.entrypoints.cli.main"]


def vllm_cmd(args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """`vllm serve` with its defaults on the model folder."""
    cmd = [*vllm_cli(args), "serve", args.model, "--port", str(port), "--dtype", "bfloat16"]
    cmd += ["--max-model-len", str(args.max_model_len)]
    return cmd, vllm_env(args)


class Server:
    """A server process in its own session, stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /health until 200; a dead process or the timeout raises with the log's tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 20) -> str:
        """The last lines of the server's log."""
        self._log_file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """SIGTERM to the whole session, SIGKILL after 30 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_file.close()


def client_cmd(
    args: argparse.Namespace, url: str, rate: float, seed: int, out: Path
) -> tuple[list[str], dict]:
    """The client's command line: the same dataset flags for either client."""
    flags = ["--base-url", url, "--model", args.model, "--dataset-name", "random"]
    flags += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    flags += [
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        "inf" if math.isinf(rate) else f"{rate:.4f}",
    ]
    flags += ["--seed", str(seed), "--ignore-eos", "--save-result", "--result-dir", str(out.parent)]
    flags += ["--result-filename", out.name, "--metric-percentiles", "50,90,99"]
    if args.client == "vllm":
        flags += ["--backend", "openai", "--endpoint", "/v1/completions", "--tokenizer", args.model]
        flags += ["--percentile-metrics", "ttft,tpot,itl,e2el"]
        return [*vllm_cli(args), "bench", "serve", *flags], vllm_env(args)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return [sys.executable, "-m", "llmsched.cli", "bench", "serve", *flags, "--disable-tqdm"], env


def run_client(args: argparse.Namespace, url: str, rate: float, seed: int, tmp: Path, tag: str) -> dict:
    """One client run; its result JSON."""
    out = tmp / f"{tag}.json"
    cmd, env = client_cmd(args, url, rate, seed, out)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.run_timeout_s)
    if not out.exists():
        raise RuntimeError(f"client failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return json.loads(out.read_text())


def drive(args: argparse.Namespace, name: str, loads: list[tuple[str, float]], tmp: Path) -> list[dict]:
    """Start server ``name``, run every load --repeats times, stop it; one record per run."""
    port = free_port()
    cmd, env = (llmsched_cmd if name == "llmsched" else vllm_cmd)(args, port)
    server = Server(name, cmd, env, port, tmp / f"{name}-server.log")
    runs = []
    try:
        server.wait_ready(args.start_timeout_s)
        for li, (load, rate) in enumerate(loads):
            for rep in range(args.repeats):
                seed = args.seed + 1000 * li + rep
                res = run_client(args, server.url, rate, seed, tmp, f"{name}-{load}-{rep}")
                rec = {"server": name, "load": load, "rate": rate, "repeat": rep, "seed": seed}
                rec.update({k: res.get(k) for k in (*SUMMARY_KEYS, "completed", "failed", "duration")})
                runs.append(rec)
                print(f"  {name:9} {load:6} rep {rep}: " + brief(rec), flush=True)
    finally:
        server.stop()
        startup = [
            ln for ln in server.log.read_text(errors="replace").splitlines() if "max_num_batched_tokens" in ln
        ]
        if startup:
            print(f"  {name} startup: " + " | ".join(s.strip()[-110:] for s in startup[:3]))
    return runs


def brief(rec: dict) -> str:
    """One run in a line."""
    return (
        f"{rec['output_throughput']:.1f} out tok/s, TTFT med {rec['median_ttft_ms']:.0f} ms, "
        f"TPOT med {rec['median_tpot_ms']:.1f} ms, ITL med {rec['median_itl_ms']:.1f} ms, "
        f"{rec['completed']} done / {rec['failed']} failed"
    )


def summarize(runs: list[dict]) -> dict:
    """Median over repeats, per server and load."""
    out: dict = {}
    for r in runs:
        out.setdefault(r["server"], {}).setdefault(r["load"], []).append(r)
    return {
        s: {
            load: {"rate": rs[0]["rate"], **{k: statistics.median(x[k] for x in rs) for k in SUMMARY_KEYS}}
            for load, rs in by_load.items()
        }
        for s, by_load in out.items()
    }


def poisson_loads(args: argparse.Namespace, capacity: float) -> list[tuple[str, float]]:
    """The Poisson loads: --rates, else --load-fractions of ``capacity`` (requests/s)."""
    if args.rates:
        return [(f"{r:g}/s", r) for r in args.rates]
    return [(f"{int(f * 100)}%", f * capacity) for f in args.load_fractions]


def print_table(summary: dict) -> None:
    """Server by load: the medians over repeats."""
    print(f"\n{'server':9} {'load':6} {'rate/s':>7} {'out tok/s':>9} {'TTFT med/p99 ms':>17} "
          f"{'TPOT med/p99 ms':>16} {'ITL med/p99 ms':>15}")  # fmt: skip
    for server, by_load in summary.items():
        for load, s in by_load.items():
            rate = "inf" if math.isinf(s["rate"]) else f"{s['rate']:.3f}"
            print(
                f"{server:9} {load:6} {rate:>7} {s['output_throughput']:9.1f} "
                f"{s['median_ttft_ms']:8.0f}/{s['p99_ttft_ms']:<8.0f} {s['median_tpot_ms']:7.1f}/"
                f"{s['p99_tpot_ms']:<8.1f} {s['median_itl_ms']:7.1f}/{s['p99_itl_ms']:<7.1f}"
            )


def plot(summary: dict, path: Path, title: str) -> None:
    """TTFT, TPOT and ITL (median solid, p99 dashed) against Poisson rate; all at once as its own marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [s["rate"] for by in summary.values() for s in by.values() if not math.isinf(s["rate"])]
    burst_x = max(finite, default=1.0) * 1.35
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, m in zip(axes, METRICS):
        for server, by_load in summary.items():
            pts = sorted((s["rate"], s) for s in by_load.values() if not math.isinf(s["rate"]))
            xs = [x for x, _ in pts]
            (line,) = ax.plot(xs, [s[f"median_{m}_ms"] for _, s in pts], "o-", label=f"{server} median")
            color = line.get_color()
            ax.plot(xs, [s[f"p99_{m}_ms"] for _, s in pts], "s--", color=color, label=f"{server} p99")
            # The burst is not a rate: a marker of its own, joined to nothing.
            for s in by_load.values():
                if math.isinf(s["rate"]):
                    ax.plot([burst_x], [s[f"median_{m}_ms"]], "*", ms=12, color=color)
                    ax.plot([burst_x], [s[f"p99_{m}_ms"]], "x", ms=9, color=color)
        ax.axvline(burst_x / 1.175, color="grey", lw=0.8, ls=":")
        ticks = sorted({round(x, 2) for x in finite})
        ax.set_xticks([*ticks, burst_x], [*(f"{t:g}" for t in ticks), "all at\nonce"], fontsize=8)
        ax.set_title(m.upper())
        ax.set_xlabel("Poisson request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model folder both servers load")
    p.add_argument("--vllm-python", default=None, help="Python with vLLM installed (else vLLM is skipped)")
    p.add_argument(
        "--vllm-cli", default=None, help="a script running vLLM's CLI (default: python -m vllm...)"
    )
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (default 4)")
    p.add_argument(
        "--vllm-omp-bind",
        default=all_cores(),
        help="VLLM_CPU_OMP_THREADS_BIND (default: every usable core, the same cores llmsched gets; "
        "'auto' is vLLM's serve default, its engine on every core but one)",
    )
    p.add_argument(
        "--llmsched-threads",
        type=int,
        default=None,
        help="llmsched's --num-threads (default: its own default, every usable CPU)",
    )
    p.add_argument(
        "--client", choices=("llmsched", "vllm"), default="llmsched", help="who drives both servers"
    )
    p.add_argument("--servers", default="llmsched,vllm", help="comma-separated, in order (default both)")
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="llmsched serve's engine ranks (--data-parallel-size; default 1, one engine)",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1, help="first dataset seed; each load and repeat adds to it")
    p.add_argument(
        "--load-fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.3, 0.6, 0.9, 1.1]
    )
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--run-timeout-s", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=ROOT / "results/serve_vs_vllm.json")
    p.add_argument("--plot", type=Path, default=ROOT / "results/serve_vs_vllm.png")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Burst on each server (capacity), then the Poisson loads on each; JSON, table and plot."""
    args = parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    if "vllm" in servers and not args.vllm_python:
        print("vllm serve: skipped (no --vllm-python given)")
        servers.remove("vllm")
    if args.client == "vllm" and not args.vllm_python:
        raise SystemExit("--client vllm needs --vllm-python")
    runs: list[dict] = []
    if "llmsched" in servers:
        print(f"llmsched runs: {llmsched_configuration(args)['command']}")
    if "vllm" in servers:
        print(f"vllm runs: {vllm_configuration(args)['command']}, OMP bind {args.vllm_omp_bind}")
    with tempfile.TemporaryDirectory(prefix="serve_vs_vllm-") as d:
        tmp = Path(d)
        print(f"burst: {args.num_prompts} x {args.input_len}/{args.output_len} tokens, all at once")
        for s in servers:
            runs += drive(args, s, [("burst", math.inf)], tmp)
        capacity = min(
            statistics.median(r["request_throughput"] for r in runs if r["server"] == s) for s in servers
        )
        loads = poisson_loads(args, capacity)
        print(f"capacity (lower of the servers' burst request rates): {capacity:.3f}/s; Poisson loads: "
              + ", ".join(f"{n} = {r:.3f}/s" for n, r in loads))  # fmt: skip
        for s in servers:
            runs += drive(args, s, loads, tmp)
    summary = summarize(runs)
    print_table(summary)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = {"config": cfg, "servers": servers, "capacity_rps": capacity, "runs": runs, "summary": summary}
    data["llmsched_configuration"] = llmsched_configuration(args)
    if "vllm" in servers:
        data["vllm_configuration"] = vllm_configuration(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record_cpu(data), indent=2))
    print(f"wrote {args.json}")
    shape = f"{args.num_prompts} x {args.input_len}/{args.output_len}"
    title = f"{Path(args.model).name}: {shape}, {args.client} client, vLLM bound to {args.vllm_omp_bind}"
    title += f"; {data['cpu_model']}"
    plot(summary, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
