"""Backpressure: how many requests and prompt tokens may be in flight before new ones get 503.

Counted on the event loop when a request is submitted and when its outputs
arrive, so the check needs no lock and a refused request never reaches the
engine's queues.
"""

from __future__ import annotations

from dataclasses import dataclass

REASON_REQUESTS = "max_num_queued_reqs"
REASON_TOKENS = "max_num_queued_tokens"


class Overloaded(Exception):
    """A queue limit is reached; the reason is vLLM's admission-rejection label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class AdmissionControl:
    """In-flight request and queued-prompt-token counts against their limits."""

    max_requests: int
    max_queued_tokens: int | None = None
    num_requests: int = 0
    num_queued_tokens: int = 0

    def acquire(self, prompt_len: int) -> None:
        """Count a new request in, or raise Overloaded leaving the counts unchanged."""
        if self.num_requests >= self.max_requests:
            raise Overloaded(
                REASON_REQUESTS,
                f"the server is at its limit of {self.max_requests} requests in flight "
                "(--max-num-queued-requests); retry later",
            )
        cap = self.max_queued_tokens
        # A lone request is always let in, so no prompt is refused forever.
        if cap is not None and self.num_queued_tokens and self.num_queued_tokens + prompt_len > cap:
            raise Overloaded(
                REASON_TOKENS,
                f"{self.num_queued_tokens} prompt tokens are waiting for their first token and this "
                f"request adds {prompt_len}, over the limit of {cap} (--max-num-queued-tokens); retry later",
            )
        self.num_requests += 1
        self.num_queued_tokens += prompt_len

    def started(self, prompt_len: int) -> None:
        """The request produced its first token (or ended): its prompt no longer waits."""
        self.num_queued_tokens -= prompt_len

    def release(self) -> None:
        """The request finished, failed or was aborted."""
        self.num_requests -= 1
