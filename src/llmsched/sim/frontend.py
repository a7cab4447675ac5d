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

The output path: for every output token the server detokenizes and streams
an SSE chunk to the client, so with ``output_token_s`` > 0 a server is one
serial resource shared by both paths (``ApiServers``). Its jobs: a request's
input (``request_s`` plus ``token_s`` per prompt token) when it is sent, and
each engine step's output tokens (``output_token_s`` each) when the step
ends; each server works through them in arrival order. The client sees a
token when its server has streamed it: TTFT, TPOT, end-to-end latency, the
run's duration and, in a closed loop, when a client sends its next request
follow those times. A step's tokens are shared evenly among the servers
(requests are dealt round-robin), and all of a step's tokens are seen when
its job is done. Part of a streamed token's cost is its SSE chunk's
(``chunk_s``): a step whose output queues behind output jobs not yet
started pays it only for streams those jobs lack, as vLLM merges the
outputs a stream has not sent into one chunk, so a server that falls
behind does less work per token. The fixed per-request cost (HTTP,
validation, the first and last chunks) is charged with the input. ITL and
the tokens/s peak stay engine times.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Sequence

from llmsched.core.errors import ConfigError

# vLLM's own API server process (`vllm serve`, vLLM 0.32.0's CPU build serving
# SmolLM2-135M, streaming), CPU seconds apart from its engine core's, measured
# on this project's 2-core AMD EPYC (shared with other work) by
# benchmarks/serving/api_server_cost.py: medians of 3 runs of 128 requests at
# once, the idle rate taken off. Per request: an 8-token prompt and one output
# token, less its tokens; per prompt token: refused 2,500- against 5,000-token
# prompts; per streamed output token: 17 against 1 output token, each its own
# SSE chunk. Runs on this shared machine spread by about a quarter (an earlier
# run: 1.18 ms, 1.81 us, 54.7 us). Used for every hardware profile: a GPU
# host's CPU may well be faster, which these defaults do not assume (the
# flags --api-server-us-per-* set other figures).
DEFAULT_REQUEST_S = 1.56e-3
DEFAULT_TOKEN_S = 1.55e-6
DEFAULT_OUTPUT_TOKEN_S = 43.3e-6
# The fixed cost through /v1/chat/completions (the chat template too; within
# the spread of the completions figure).
CHAT_REQUEST_S = 1.28e-3
# The part of a streamed token's cost paid per SSE chunk (JSON, the write, the
# stream's wake-up) rather than per token (detokenizing, bookkeeping): the
# same requests answered whole (stream false) cost 16.2 us a token.
DEFAULT_CHUNK_S = 27.2e-6
DEFAULT_CHUNK_SHARE = DEFAULT_CHUNK_S / DEFAULT_OUTPUT_TOKEN_S


class Frontend:
    """``count`` API servers and their seconds of work per request, prompt token and output token."""

    __slots__ = ("chunk_s", "count", "output_token_s", "request_s", "token_s")

    def __init__(
        self,
        count: int,
        token_s: float = DEFAULT_TOKEN_S,
        request_s: float = DEFAULT_REQUEST_S,
        output_token_s: float = DEFAULT_OUTPUT_TOKEN_S,
        chunk_s: float | None = None,
    ) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"api_server_count={count!r} must be a positive integer")
        for value, what in (
            (token_s, "per prompt token"),
            (request_s, "per request"),
            (output_token_s, "per output token"),
        ):
            if not value >= 0:
                raise ConfigError(f"API server time {what} {value!r} s must be >= 0")
        if chunk_s is None:
            # The measured share of a streamed token's cost that is its chunk's.
            chunk_s = output_token_s * DEFAULT_CHUNK_SHARE
        if not 0 <= chunk_s <= output_token_s:
            raise ConfigError(
                f"API server time per SSE chunk {chunk_s!r} s must be >= 0 and at most the time per "
                f"streamed output token ({output_token_s!r} s), of which it is a part"
            )
        self.chunk_s = chunk_s
        self.count = count
        self.token_s = token_s
        self.request_s = request_s
        self.output_token_s = output_token_s

    @property
    def streams(self) -> bool:
        """True when the servers also pay for the output (a queue shared by both paths, ``ApiServers``)."""
        return self.output_token_s > 0

    def input_s(self, prompt_len: int) -> float:
        """A server's seconds to take in a request of ``prompt_len`` tokens and pass it on."""
        return self.request_s + self.token_s * prompt_len

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
        return (sent if sent > free else free) + self.input_s(prompt_len)

    def to_dict(self) -> dict:
        """The settings, for the trace header and the result JSON."""
        return {
            "api_server_count": self.count,
            "seconds_per_request": self.request_s,
            "seconds_per_prompt_token": self.token_s,
            "seconds_per_output_token": self.output_token_s,
            "seconds_per_chunk": self.chunk_s,
        }

    def describe(self) -> str:
        """One line for the run's header."""
        out = (
            f"; {self.output_token_s * 1e6:g} us per streamed output token ({self.chunk_s * 1e6:g} of it per "
            "chunk), sharing the server"
            if self.streams
            else ""
        )
        return (
            f"{self.count} API server{'s' if self.count > 1 else ''}, {self.request_s * 1e6:g} us a request "
            f"and {self.token_s * 1e6:g} us per prompt token (tokenize and send to the engine core){out}; "
            "requests reach the engine over time"
        )


class ApiServers:
    """The API servers as serial queues of input and output jobs (``Frontend.streams``).

    A request's input is committed (``commit``) once it is sent and every
    job that arrived before it is in; a step's output (``output``) when the
    step ends. ``seen(t)`` is when the client sees what the engine produced
    at ``t``: when the servers finished the last output job that arrived by
    ``t`` (``t`` itself when none is later).
    """

    __slots__ = (
        "busy",
        "committed",
        "fe",
        "free",
        "group_chunks",
        "group_start",
        "last_seen",
        "reach",
        "sent",
        "step_ends",
        "step_seen",
    )

    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend
        self.free = [0.0] * frontend.count
        # Per committed request, in workload order: when it was sent and reached the engine.
        self.sent = array("d")
        self.reach = array("d")
        self.committed = 0
        # Per output job: the step's end (ascending) and when its tokens were streamed.
        self.step_ends = array("d")
        self.step_seen = array("d")
        self.last_seen = 0.0
        # Per server, the output jobs queued together at its tail: when the first
        # starts (-inf: the tail is a request's input) and the most streams in one.
        self.group_start = [-math.inf] * frontend.count
        self.group_chunks = [0.0] * frontend.count
        # Seconds of work the servers have been given, all together.
        self.busy = 0.0

    def commit(self, sent: float, prompt_len: int) -> float:
        """Queue the next request's input (sent at ``sent``); when it reaches the engine."""
        free = self.free
        s = self.committed % len(free)
        f = free[s]
        cost = self.fe.input_s(prompt_len)
        free[s] = done = (sent if sent > f else f) + cost
        self.busy += cost
        self.group_start[s] = -math.inf
        self.sent.append(sent)
        self.reach.append(done)
        self.committed += 1
        return done

    def reach_bound(self, i: int, sent: float, prompt_len: int) -> float:
        """The earliest request ``i`` (the next to commit) can reach the engine, were it sent at ``sent``."""
        return self.fe.done_at(sent, self.free[i % len(self.free)], prompt_len)

    def output(self, t: float, tokens: int) -> float:
        """Queue a step's ``tokens`` output tokens, produced at ``t``; when the client has them all.

        A step whose output joins output jobs still waiting at the server's
        tail shares their chunks: it pays the per-chunk part only for
        streams beyond the most those jobs had (vLLM merges the outputs a
        stream has not sent yet into one chunk).
        """
        fe, free = self.fe, self.free
        share = tokens / len(free)
        per_token = (fe.output_token_s - fe.chunk_s) * share
        starts, chunks = self.group_start, self.group_chunks
        done = t
        for s, f in enumerate(free):
            start = t if t > f else f
            if starts[s] > t:
                new_chunks = share - chunks[s] if share > chunks[s] else 0.0
                if share > chunks[s]:
                    chunks[s] = share
            else:
                starts[s], chunks[s], new_chunks = start, share, share
            cost = per_token + fe.chunk_s * new_chunks
            self.busy += cost
            free[s] = f = start + cost
            if f > done:
                done = f
        ends = self.step_ends
        if ends and t < ends[-1]:
            # A rank's step that ended before another's already queued: seen no earlier than that.
            t = ends[-1]
        ends.append(t)
        self.step_seen.append(done)
        if done > self.last_seen:
            self.last_seen = done
        return done

    def horizon(self) -> float:
        """The latest step end whose output is queued (-inf: none yet)."""
        return self.step_ends[-1] if self.step_ends else -float("inf")

    def seen(self, t: float) -> float:
        """When the client sees what the engine produced at ``t``."""
        k = bisect_right(self.step_ends, t) - 1
        if k < 0:
            return t
        done = self.step_seen[k]
        return done if done > t else t
