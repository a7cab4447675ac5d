"""The API servers in front of an engine core: requests reach the engine over time, not at once.

vLLM's OpenAI server (``--api-server-count N`` processes) tokenizes each
request and hands it to the engine core over IPC; the engine core steps as
soon as it has work. So a burst sent at once arrives at the engine one
request per tokenize-and-send time per server, and the first steps see only
the first few (seed 000's "2, 5 or 7 of 16 prompts in the first step").

The model: requests are dealt to the servers round-robin; each server
handles its requests one after another, ``token_s`` per prompt token each
(tokenizing and sending grow with the prompt), so request i reaches the
engine at ``max(sent_i, server free) + token_s x prompt_len_i``. Without a
frontend the engine gets every request at its send time (llmsched's offline
path, which queues a whole batch before the first step). With data-parallel
ranks each server also routes its requests (``engine.dp.ApiServerRouter``).
"""

from __future__ import annotations

import statistics
import time
from array import array
from collections.abc import Sequence

from llmsched.core.errors import ConfigError

# Per prompt token, one API server: tokenizing a 1024-token prompt with the
# embedded model's tokenizer and sending its ids to another process through a
# pipe, as the torch path's server does, took medians of 0.47-0.50 ms on this
# project's 2-core x86 machine (``measure_request_s()``). Used for every
# hardware profile unless --api-server-us-per-token says otherwise.
DEFAULT_TOKEN_S = 0.48e-6


class Frontend:
    """``count`` API servers, ``token_s`` seconds of work per prompt token."""

    __slots__ = ("count", "token_s")

    def __init__(self, count: int, token_s: float = DEFAULT_TOKEN_S) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"api_server_count={count!r} must be a positive integer")
        if not token_s >= 0:
            raise ConfigError(f"API server time per prompt token {token_s!r} s must be >= 0")
        self.count = count
        self.token_s = token_s

    def delivery_times(self, sent: Sequence[float], prompt_lens: Sequence[int]) -> array:
        """When each request (sent at ``sent``, in order, with ``prompt_lens``) reaches the engine core."""
        free = [0.0] * self.count
        out = array("d")
        for i, t in enumerate(sent):
            s = i % self.count
            free[s] = done = self.done_at(t, free[s], prompt_lens[i])
            out.append(done)
        return out

    def done_at(self, sent: float, free: float, prompt_len: int) -> float:
        """When a server that is free from ``free`` has passed on a request sent at ``sent``."""
        return (sent if sent > free else free) + self.token_s * prompt_len

    def to_dict(self) -> dict:
        """The settings, for the trace header and the result JSON."""
        return {"api_server_count": self.count, "seconds_per_prompt_token": self.token_s}

    def describe(self) -> str:
        """One line for the run's header."""
        return (
            f"{self.count} API server{'s' if self.count > 1 else ''}, {self.token_s * 1e6:g} us per prompt "
            f"token (tokenize and send to the engine core); requests reach the engine over time"
        )


def measure_request_s(prompt_len: int = 1024, repeats: int = 30) -> float:
    """Median seconds to tokenize a ``prompt_len``-token prompt and pipe its ids to another process."""
    import multiprocessing as mp
    from pathlib import Path

    from llmsched.engine.tokenizer import load_tokenizer

    folder = Path.home() / ".cache" / "llmsched" / "embedded-qwen3-v1"
    if not folder.exists():
        raise ConfigError(
            f"measuring the API server's cost needs the embedded model at {folder} (llmsched generate)"
        )
    tok = load_tokenizer(folder)
    # About four tokens per word with this tokenizer.
    text = " ".join(f"w{i % 97}" for i in range(prompt_len // 4))
    recv, send = mp.Pipe(duplex=False)
    reader = mp.get_context("fork").Process(target=_drain, args=(recv, repeats))
    reader.start()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ids = tok.encode(text)
        send.send(ids)
        times.append(time.perf_counter() - t0)
    reader.join()
    return statistics.median(times)


def _drain(conn: object, n: int) -> None:
    for _ in range(n):
        conn.recv()
