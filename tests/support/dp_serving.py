"""Requests and /metrics readings shared by the data-parallel serving tests."""

from __future__ import annotations

import threading

import httpx

# Upper bounds on waits only catch a hang: a loaded host may be slow, never this slow.
HANG_S = 60.0
# A dead rank must be reported within this many seconds (its pipe or link closes with the process).
REPORT_S = 10.0
PROMPTS = [f"Request {i}: the scheduler admits what fits in the token budget" for i in range(8)]
ENGINE = {"max_model_len": 1024, "num_gpu_blocks_override": 256, "block_size": 16, "num_threads": 1}


def complete(base: str, prompt: str, **kw: object) -> dict:
    """One greedy completion that must succeed."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **kw}
    r = httpx.post(base + "/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    return r.json()


def metric_samples(base: str, name: str) -> dict[str, float]:
    """``name``'s samples from /metrics by their ``engine`` label."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=HANG_S).text.splitlines():
        if line.startswith(name + "{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] = float(line.rsplit(" ", 1)[1])
    return out


def stream_lines(base: str, prompt: str, started: threading.Event) -> list[str]:
    """A long streaming completion's data lines; ``started`` is set at the first one."""
    body = {"prompt": prompt, "max_tokens": 900, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=HANG_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                started.set()
    return lines
