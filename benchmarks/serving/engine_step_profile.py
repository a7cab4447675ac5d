#!/usr/bin/env python3
"""Where the serving engine process spends its time per step, sampled with py-spy.

Starts `llmsched serve` on --model, drives it with `llmsched bench serve`
(--concurrency requests in flight, each --input-len prompt tokens and
--output-len output tokens: a decode-heavy load like a few users chatting),
and samples the engine process with py-spy (non-blocking, active threads
only) for --duration seconds in the middle of the run. Every sample is put
in one bucket by the innermost frame that names a known place: the model
(the executor's forward and sampler), the scheduler, output building,
detokenization, the step log and trace, the snapshot, serialization and the
pipe (encode_batch, pickling, send), command handling, and the rest. The
per-step cost of each bucket is its sampled seconds over the engine steps
counted in the same window.

--src runs the same measurement for other source trees (e.g. an older
checkout unpacked with `git archive`) one after the other, so a before/after
breakdown comes from one run of this script on one machine.

    python benchmarks/serving/engine_step_profile.py --model DIR --py-spy PATH \\
        --src before=/tmp/before/src --src after=src --json results/engine_step_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))

from hostcpu import record_cpu
from serve_vs_vllm import Server, free_port

ROOT = Path(__file__).resolve().parents[2]

# (bucket, frame pattern): the first bucket whose pattern matches a frame,
# searching from the innermost frame outwards, takes the sample.
BUCKETS: list[tuple[str, re.Pattern]] = [
    ("detokenize", re.compile(r"\((?:.*/)?detokenizer\.py|\((?:.*/)?stop_strings\.py|tokenizers")),
    ("serialize+pipe", re.compile(r"encode_batch|connection\.py|reduction\.py|\bpickle|_send_bytes|emit \(")),
    ("step log+trace", re.compile(r"\((?:.*/)?step_log\.py|\((?:.*/)?trace\.py|StepRecord")),
    ("snapshot", re.compile(r"snapshot \(|waiting_by_reason|drain_evictions")),
    ("model", re.compile(r"\((?:.*/)?executor/torch/|torch/|execute_model|sample_tokens")),
    ("scheduler", re.compile(r"\((?:.*/)?core/(?:scheduler|kv/|policy|request)")),
    (
        "output building",
        re.compile(r"make_output|new_token_ids|OutputDelta|RequestOutput|llm_engine\.py|outputs\.py"),
    ),
    ("commands", re.compile(r"_drain \(|_add \(|_release_held|add_request|abort_request")),
    ("engine loop", re.compile(r"engine_loop\.py|engine_core\.py")),
]


# The HTTP process (the same sampling), for what it takes from the cores the engine shares.
HTTP_BUCKETS: list[tuple[str, re.Pattern]] = [
    ("pipe reader", re.compile(r"process_backend\.py|decode_batch|connection\.py|reduction\.py")),
    ("json", re.compile(r"\bjson/|orjson|jsonable|model_dump|pydantic")),
    ("llmsched routes+streams", re.compile(r"llmsched/server/")),
    ("http (uvicorn, starlette)", re.compile(r"uvicorn|h11|httptools|starlette|fastapi|anyio")),
    ("event loop", re.compile(r"asyncio")),
]


def spy_cmd(args: argparse.Namespace, pid: int, raw: Path) -> list[str]:
    """py-spy sampling ``pid`` into ``raw`` without pausing it."""
    cmd = [
        args.py_spy,
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(args.rate),
        "--duration",
        str(args.duration),
    ]
    return [*cmd, "--format", "raw", "--output", str(raw), "--nonblocking", *(["--gil"] if args.gil else [])]


def classify(stack: str, buckets: list[tuple[str, re.Pattern]] = BUCKETS) -> str:
    """The bucket of one sampled stack (frames outermost first, ';'-separated)."""
    for frame in reversed(stack.split(";")):
        for name, pat in buckets:
            if pat.search(frame):
                return name
    return "other"


def parse_raw(path: Path, known: list[tuple[str, re.Pattern]] = BUCKETS) -> tuple[Counter, int]:
    """py-spy raw output: samples per bucket, and in all."""
    buckets: Counter = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        buckets[classify(stack, known)] += n
        total += n
    return buckets, total


def engine_pid(server_pid: int, timeout_s: float = 30.0) -> int:
    """The engine process: the server's child running multiprocessing's spawn (not its tracker)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{server_pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                    return int(pid)
        time.sleep(0.5)
    raise RuntimeError("no engine process found under the server")


def num_steps(url: str) -> int:
    """The server's engine step counter."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = re.search(rb"^llmsched:engine_steps_total(?:\{[^}]*\})? ([0-9.e+]+)$", r.read(), re.M)
    return int(float(m.group(1))) if m else 0


def debug_steps(url: str, last: int) -> list[dict]:
    """The last engine step records (duration_ms, cpu_ms, num_running ...)."""
    with urllib.request.urlopen(f"{url}/debug/steps?last={last}", timeout=10) as r:
        data = json.loads(r.read())
    return data["steps"] if isinstance(data, dict) else data


def measure(args: argparse.Namespace, label: str, src: Path, tmp: Path) -> dict:
    """One source tree: serve, load, sample; the breakdown per step."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "llmsched.cli", "serve", args.model, "--port", str(port)]
    cmd += ["--max-model-len", "2048", "--log-level", "warning"]
    server = Server(label, cmd, env, port, tmp / f"{label}-server.log")
    try:
        server.wait_ready(args.start_timeout_s)
        pid = engine_pid(server.proc.pid)
        client_json = tmp / f"{label}-client.json"
        cmd = [*client_cmd(args, server.url, src), "--result-json", str(client_json)]
        client = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        time.sleep(args.warmup_s)
        s0 = num_steps(server.url)
        raw, http_raw = tmp / f"{label}.txt", tmp / f"{label}-http.txt"
        spies = [subprocess.Popen(spy_cmd(args, p, r), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for p, r in ((pid, raw), (server.proc.pid, http_raw))]  # fmt: skip
        for spy in spies:
            spy.wait()
        steps = num_steps(server.url) - s0
        records = debug_steps(server.url, max(1, min(steps, 256)))
        client.wait(args.run_timeout_s)
    finally:
        server.stop()
    buckets, total = parse_raw(raw)
    per_step = {k: v / args.rate / max(steps, 1) * 1000.0 for k, v in buckets.most_common()}
    http, _ = parse_raw(http_raw, HTTP_BUCKETS)
    http_per_step = {k: v / args.rate / max(steps, 1) * 1000.0 for k, v in http.most_common()}
    decode = [r for r in records if r.get("num_scheduled_tokens", 0) <= r.get("num_running", 0)]
    prefill = [r for r in records if r.get("num_scheduled_tokens", 0) > r.get("num_running", 0)]
    seen = json.loads(client_json.read_text()) if client_json.exists() else {}
    return {
        "label": label,
        "src": str(src),
        "steps": steps,
        "samples": total,
        "ms_per_step": per_step,
        "active_ms_per_step": sum(per_step.values()),
        "http_ms_per_step": http_per_step,
        "http_active_ms_per_step": sum(http_per_step.values()),
        "step_duration_ms_median": median([r["duration_ms"] for r in decode]),
        "step_cpu_ms_median": median([r["cpu_ms"] for r in decode]),
        "running_median": median([r["num_running"] for r in decode]),
        "prefill_step_ms_median": median([r["duration_ms"] for r in prefill]),
        "prefill_tokens_per_s": sum(r["num_scheduled_tokens"] for r in prefill)
        / max(sum(r["duration_ms"] for r in prefill) / 1000.0, 1e-9),
        **{k: seen.get(k, float("nan")) for k in CLIENT_KEYS},
    }


CLIENT_KEYS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "output_throughput")


def median(xs: list[float]) -> float:
    """The median, NaN for none."""
    xs = sorted(xs)
    return float("nan") if not xs else (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2


def client_cmd(args: argparse.Namespace, url: str, src: Path) -> list[str]:
    """The load: --concurrency streams of --input-len/--output-len tokens."""
    flags = ["--base-url", url, "--dataset-name", "random", "--random-input-len", str(args.input_len)]
    flags += ["--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts)]
    flags += ["--max-concurrency", str(args.concurrency), "--seed", "1", "--ignore-eos", "--disable-tqdm"]
    return [sys.executable, "-m", "llmsched.cli", "bench", "serve", *flags]


def report(results: list[dict]) -> None:
    """Buckets as rows, source trees as columns (ms of engine-process CPU per step)."""
    names = sorted(
        {k for r in results for k in r["ms_per_step"]}, key=lambda k: -results[0]["ms_per_step"].get(k, 0)
    )
    print(f"\n{'ms per engine step':22}" + "".join(f"{r['label']:>12}" for r in results))
    for k in names:
        print(f"{k:22}" + "".join(f"{r['ms_per_step'].get(k, 0.0):12.2f}" for r in results))
    print(f"{'HTTP process':22}")
    http_names = sorted({k for r in results for k in r["http_ms_per_step"]})
    for k in http_names:
        print(f"  {k:20}" + "".join(f"{r['http_ms_per_step'].get(k, 0.0):12.2f}" for r in results))
    for key, title in (
        ("active_ms_per_step", "engine, all"),
        ("http_active_ms_per_step", "HTTP process, all"),
        ("step_duration_ms_median", "decode step (wall)"),
        ("step_cpu_ms_median", "decode step (CPU)"),
        ("running_median", "running (median)"),
        ("prefill_step_ms_median", "prefill step (wall)"),
        ("prefill_tokens_per_s", "prefill tokens/s"),
        ("median_ttft_ms", "client TTFT median"),
        ("median_tpot_ms", "client TPOT median"),
        ("median_itl_ms", "client ITL median"),
        ("output_throughput", "client out tok/s"),
        ("steps", "steps sampled"),
    ):
        print(f"{title:22}" + "".join(f"{r[key]:12.2f}" for r in results))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--py-spy", default="py-spy", help="the py-spy binary")
    p.add_argument("--src", action="append", default=None, metavar="LABEL=DIR", help="(default: this tree)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rate", type=int, default=200, help="py-spy samples/s")
    p.add_argument(
        "--gil",
        action="store_true",
        help="count only samples holding the GIL: what one thread's Python costs the model thread",
    )
    p.add_argument("--duration", type=int, default=20, help="seconds sampled")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--run-timeout-s", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=ROOT / "results/engine_step_profile.json")
    p.add_argument(
        "--raw-dir", type=Path, default=None, help="keep py-spy's raw stacks and the server logs here"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Measure each source tree in turn; print and write the breakdown."""
    args = parse_args(argv)
    srcs = [s.split("=", 1) for s in (args.src or [f"this={ROOT / 'src'}"])]
    results = []
    with tempfile.TemporaryDirectory(prefix="engine_step_profile-") as d:
        out = args.raw_dir or Path(d)
        out.mkdir(parents=True, exist_ok=True)
        for label, src in srcs:
            print(f"{label}: {src}", flush=True)
            results.append(measure(args, label, Path(src).resolve(), out))
    report(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            record_cpu({"config": {k: str(v) for k, v in vars(args).items()}, "results": results}),
            indent=2,
        )
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
