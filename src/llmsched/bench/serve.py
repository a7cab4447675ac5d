"""`llmsched bench serve`'s client: streamed completions against a running server, timed per token.

Requests go out at ``request_rate`` per second (Poisson arrivals, seeded;
inf sends all at once), at most ``max_concurrency`` in flight, each
streaming ``/v1/completions`` with ``ignore_eos`` (unless turned off) so it
generates exactly its output length. Each chunk's arrival is a token time (a chunk that
carries several tokens counts once, as ``vllm bench serve`` counts it); the
output length is the server's usage figure. The summary is
``llmsched.bench.metrics``'s, the same keys as ``bench throughput``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from llmsched.bench.metrics import DEFAULT_PERCENTILES, RequestTiming, summarize
from llmsched.bench.throughput import BenchRequest

# Token ids random prompts draw from: every tokenizer has them (byte-level
# vocabularies map them to printable ASCII), and the client needs no tokenizer.
RANDOM_PROMPT_IDS = range(32, 127)


@dataclass(slots=True)
class ServeBenchConfig:
    """Where to send what, how fast."""

    base_url: str
    model: str | None = None
    endpoint: str = "/v1/completions"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 3600.0
    # vLLM's --burstiness: arrival gaps are gamma-distributed with this shape
    # (1 is Poisson; lower is burstier) around the same mean rate.
    burstiness: float = 1.0
    # Generate exactly each request's output length (vLLM's --ignore-eos).
    ignore_eos: bool = True


@dataclass(slots=True)
class ServeBenchResult:
    """Per-request timings and the wall-clock span they cover."""

    timings: list[RequestTiming]
    duration: float
    errors: list[str]

    def summary(
        self, percentiles: Sequence[float] = DEFAULT_PERCENTILES, goodput: dict | None = None
    ) -> dict:
        """llmsched.bench.metrics summary (vLLM's keys)."""
        return summarize(self.timings, self.duration, goodput, percentiles)


def arrival_delays(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds between consecutive sends: exponential gaps at ``rate``/s (gamma of shape
    ``burstiness`` when not 1, as vLLM), all zero for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    if burstiness == 1.0:
        return [rng.expovariate(rate) for _ in range(n)]
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]


async def _one(
    session: aiohttp.ClientSession, cfg: ServeBenchConfig, req: BenchRequest, errors: list[str]
) -> RequestTiming:
    prompt_len = len(req.prompt) if isinstance(req.prompt, list) else 0
    body = {
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "ignore_eos": cfg.ignore_eos,
        "temperature": 1.0,
        "top_p": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.model:
        body["model"] = cfg.model
    if req.json_schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": req.json_schema},
        }
    timing = RequestTiming(start=time.perf_counter(), prompt_len=prompt_len)
    last = math.nan
    chunks = 0
    try:
        async with session.post(cfg.base_url.rstrip("/") + cfg.endpoint, json=body) as resp:
            if resp.status != 200:
                errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                timing.success = False
                return timing
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if "error" in msg:
                    raise RuntimeError(msg["error"].get("message", "error event"))
                if msg.get("usage"):
                    timing.output_len = msg["usage"]["completion_tokens"]
                    timing.prompt_len = msg["usage"]["prompt_tokens"]
                choices = msg.get("choices") or ()
                if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                    if chunks == 0:
                        timing.first_token = now
                    else:
                        timing.itl.append(now - last)
                    last = now
                    chunks += 1
        timing.end = time.perf_counter()
        if chunks == 0:
            raise RuntimeError("the stream carried no tokens")
        if timing.output_len == 0:
            timing.output_len = chunks
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
        errors.append(f"{type(e).__name__}: {e}")
        timing.success = False
    return timing


async def run_serve_bench(
    cfg: ServeBenchConfig,
    requests: Sequence[BenchRequest],
    on_done: Callable[[RequestTiming], None] | None = None,
) -> ServeBenchResult:
    """Send every request as configured; returns their timings."""
    limit = cfg.max_concurrency or 0
    sem = asyncio.Semaphore(limit) if limit else None
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    errors: list[str] = []

    async def guarded(req: BenchRequest) -> RequestTiming:
        if sem is None:
            t = await _one(session, cfg, req, errors)
        else:
            async with sem:
                t = await _one(session, cfg, req, errors)
        if on_done is not None:
            on_done(t)
        return t

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        start = time.perf_counter()
        tasks = []
        for req, delay in zip(
            requests, arrival_delays(len(requests), cfg.request_rate, cfg.seed, cfg.burstiness)
        ):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(guarded(req)))
        timings = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return ServeBenchResult(timings, duration, errors)


async def scrape_metrics(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's /metrics as {sample name (with labels): value}; {} when unavailable."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with (
            aiohttp.ClientSession(headers=headers) as session,
            session.get(base_url.rstrip("/") + "/metrics") as resp,
        ):
            if resp.status != 200:
                return {}
            text = await resp.text()
    except aiohttp.ClientError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else ""
            )
            out[key] = s.value
    return out
