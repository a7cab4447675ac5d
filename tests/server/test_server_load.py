"""200 concurrent streaming clients, a fifth hanging up mid-stream: exact outputs, aborts, KV and metrics."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

NUM_CLIENTS = 200
PROMPT_LEN = 16
MAX_TOKENS = 24
# Every fifth client asks for far more and hangs up after a few chunks: it cannot
# finish before its disconnect is seen, however fast the engine steps.
ABANDON_AFTER = 4
ABANDON_MAX_TOKENS = 900
DEADLINE_S = 240.0


@dataclass
class ClientResult:
    """What one client saw."""

    index: int
    request_id: str = ""
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    abandoned: bool = False


async def one_client(client: openai.AsyncOpenAI, i: int, prompt: list[int]) -> ClientResult:
    """Stream one completion; every fifth client closes the stream early."""
    res = ClientResult(i)
    stream = await client.completions.create(
        model="load",
        prompt=prompt,
        max_tokens=ABANDON_MAX_TOKENS if i % 5 == 0 else MAX_TOKENS,
        temperature=1.0,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        res.request_id = chunk.id
        if chunk.usage is not None:
            res.completion_tokens = chunk.usage.completion_tokens
            res.prompt_tokens = chunk.usage.prompt_tokens
        for c in chunk.choices:
            res.chunks += 1
            res.text += c.text
            res.finish_reason = c.finish_reason or res.finish_reason
        if i % 5 == 0 and res.chunks >= ABANDON_AFTER:
            res.abandoned = True
            await stream.close()
            break
    return res


def metric_values(text: str) -> dict[str, float]:
    """Prometheus samples by name (labels other than model_name/engine appended)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + (
                "" if not extra else "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}"
            )
            out[key] = s.value
    return out


def test_200_streaming_clients_with_a_fifth_disconnecting(
    embedded_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(embedded_cache))
    engine_args = EngineArgs(max_model_len=1024, num_gpu_blocks_override=4096, max_num_seqs=256)
    server_args = ServerArgs(served_model_name=["load"], trace_steps=4096, log_level="warning")
    rng = random.Random(0)
    prompts = [[rng.randrange(32, 127) for _ in range(PROMPT_LEN)] for _ in range(NUM_CLIENTS)]
    with ServerThread(engine_args, server_args) as server:

        async def run() -> list[ClientResult]:
            limits = httpx.Limits(
                max_connections=NUM_CLIENTS + 10, max_keepalive_connections=NUM_CLIENTS + 10
            )
            async with httpx.AsyncClient(limits=limits, timeout=DEADLINE_S) as http:
                client = openai.AsyncOpenAI(
                    base_url=server.base_url + "/v1", api_key="none", max_retries=0, http_client=http
                )
                return list(
                    await asyncio.wait_for(
                        asyncio.gather(*(one_client(client, i, p) for i, p in enumerate(prompts))), DEADLINE_S
                    )
                )

        results = asyncio.run(run())
        abandoned = [r for r in results if r.abandoned]
        completed = [r for r in results if not r.abandoned]
        assert len(abandoned) == NUM_CLIENTS // 5 and len(completed) == NUM_CLIENTS - NUM_CLIENTS // 5
        for r in completed:
            assert r.finish_reason == "length", r
            assert r.completion_tokens == MAX_TOKENS and r.prompt_tokens == PROMPT_LEN
            # The embedded model writes one printable ASCII character per token.
            assert len(r.text) == MAX_TOKENS
        assert len({r.request_id for r in results}) == NUM_CLIENTS

        # Aborts land before the next step; wait (bounded) for the last to be processed.
        deadline = time.monotonic() + 30
        while server.state.engine.num_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.state.engine.num_streams == 0

        # With async scheduling a step's record is written when its output comes
        # back, one loop turn after the abort reached its client: wait (bounded).
        want = {r.request_id for r in abandoned}
        deadline = time.monotonic() + 30
        while True:
            steps = httpx.get(server.base_url + "/debug/steps", params={"last": 4096}).json()["steps"]
            aborted = {rid for step in steps for rid in step["aborted"]}
            if aborted >= want or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert aborted == want
        # An abandoned request is never scheduled again after the step its abort preceded.
        for step in steps:
            ran = {e[0] for e in step["why"]["entries"] if e[2] == "scheduled"}
            gone = {rid for s in steps if s["step"] <= step["step"] for rid in s["aborted"]}
            assert not ran & gone

        m = metric_values(httpx.get(server.base_url + "/metrics").text)
        assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        assert m["vllm:kv_cache_usage_perc"] == 0.0
        assert m["llmsched:kv_cache_free_blocks"] == m["llmsched:kv_cache_usable_blocks"] == 4095
        assert m["llmsched:num_requests_in_flight"] == 0
        assert m["vllm:request_success_total{finished_reason=length}"] == len(completed)
        assert m["vllm:request_success_total{finished_reason=abort}"] == len(abandoned)
        assert m["vllm:request_success_total{finished_reason=stop}"] == 0
        # Every client got a first token, so every prompt counts, once.
        assert m["vllm:prompt_tokens_total"] == NUM_CLIENTS * PROMPT_LEN
        assert m["vllm:time_to_first_token_seconds_count"] == NUM_CLIENTS
        assert m["vllm:e2e_request_latency_seconds_count"] == NUM_CLIENTS
        # Generated tokens: exact for the completed; for the abandoned at least what their
        # clients saw and fewer than max_tokens (they were cut short).
        gen = m["vllm:generation_tokens_total"]
        seen_abandoned = sum(len(r.text) for r in abandoned)
        assert len(completed) * MAX_TOKENS + seen_abandoned <= gen
        assert gen < len(completed) * MAX_TOKENS + len(abandoned) * ABANDON_MAX_TOKENS
        assert m["vllm:request_generation_tokens_sum"] == gen
        assert m["vllm:inter_token_latency_seconds_count"] > 0

        # A client of a non-streamed request that gives up is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.base_url + "/v1/completions",
                json={"prompt": [65] * 8, "max_tokens": ABANDON_MAX_TOKENS, "ignore_eos": True},
                timeout=httpx.Timeout(30, read=0.5),
            )
        deadline = time.monotonic() + 30
        while server.state.engine.num_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        after = metric_values(httpx.get(server.base_url + "/metrics").text)
        assert after["vllm:request_success_total{finished_reason=abort}"] == len(abandoned) + 1
        assert after["llmsched:kv_cache_free_blocks"] == 4095
