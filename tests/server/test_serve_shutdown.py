"""SIGTERM or Ctrl-C under load: stop accepting, let short requests finish, abort the rest cleanly, exit 0."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from llmsched.server.args import API_KEY_ENV

DRAIN_S = 3.0
# Upper bounds on waits only catch a hang: a loaded host may be slow, never this slow.
HANG_S = 60.0


def start_server(
    embedded_cache: Path, drain_s: float = DRAIN_S
) -> tuple[subprocess.Popen, str, queue.Queue[str]]:
    """`llmsched serve` on a free port with a drain window; returns the process, URL and stderr lines."""
    env = {**os.environ, "LLMSCHED_CACHE_DIR": str(embedded_cache)}
    env.pop(API_KEY_ENV, None)
    cmd = [
        sys.executable, "-m", "llmsched.cli", "serve", "--port", "0", "--max-model-len", "4096",
        "--max-num-seqs", "8", "--log-level", "warning", "--shutdown-timeout-s", str(drain_s),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + 90
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, "".join(seen)
            continue
        seen.append(line)
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            url = m.group(1)
            while httpx.get(url + "/health").status_code != 200:
                time.sleep(0.1)
            return proc, url, lines
    raise AssertionError("the server did not start: " + "".join(seen))


def stream(url: str, max_tokens: int, results: list, ready: threading.Event) -> None:
    """One streamed completion; records ("done", finish_reason) or ("error", code) or ("broken", text)."""
    body = {"prompt": "tell me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            ready.set()
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as e:
        results.append(("broken", repr(e)))
        return
    if not events or events[-1] != "[DONE]":
        results.append(("broken", events[-2:]))
        return
    last = json.loads(events[-2])
    if "error" in last:
        results.append(("error", last["error"]["code"]))
    else:
        results.append(("done", last["choices"][0]["finish_reason"]))


def test_sigterm_under_load_answers_every_client_and_exits_0(embedded_cache: Path) -> None:
    proc, url, _ = start_server(embedded_cache)
    try:
        results: list = []
        threads = []
        for n in (4000, 4000, 4000, 4000, 100, 100):
            ready = threading.Event()
            t = threading.Thread(target=stream, args=(url, n, results, ready))
            t.start()
            assert ready.wait(30)
            threads.append(t)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            late = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
            assert late.status_code == 503, late.text
        except httpx.TransportError:
            pass  # the listening socket is already closed: refused, as it should be
        for t in threads:
            t.join(60)
        assert proc.wait(timeout=DRAIN_S + HANG_S) == 0
        # The long streams held the server open for the whole drain window.
        assert time.monotonic() - t0 >= DRAIN_S
        assert len(results) == 6
        assert not [r for r in results if r[0] == "broken"], results
        assert results.count(("done", "length")) >= 2, results
        # The long ones still running when the drain window closed were aborted with a 503 event.
        assert ("error", 503) in results, results
        assert all(r in (("done", "length"), ("error", 503)) for r in results), results
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_second_ctrl_c_cuts_every_stream_with_an_error_event_and_done(embedded_cache: Path) -> None:
    # A drain window far longer than the test: only the second Ctrl-C can end these streams.
    proc, url, lines = start_server(embedded_cache, drain_s=600)
    try:
        results: list = []
        threads = []
        for _ in range(3):
            ready = threading.Event()
            t = threading.Thread(target=stream, args=(url, 4000, results, ready))
            t.start()
            assert ready.wait(30)
            threads.append(t)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        # Draining: the streams are still being served.
        assert proc.poll() is None and not results, results
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(30)
        assert proc.wait(timeout=30) == 0
        # Every stream ended with an error event, then data: [DONE]; none was cut.
        assert results == [("error", 503)] * 3, results
        err = []
        while not lines.empty():
            err.append(lines.get())
        assert not [x for x in err if "Exception in ASGI application" in x or "Traceback" in x], "".join(err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
