"""The server's own settings (host, port, API key, queue limits), with vLLM's flag names."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from llmsched.core.errors import ConfigError

# With no --max-num-queued-requests the queue is still bounded: this many
# in-flight requests per sequence slot, and never fewer than the floor.
DEFAULT_QUEUE_FACTOR = 4
DEFAULT_QUEUE_FLOOR = 1024
API_KEY_ENV = "LLMSCHED_API_KEY"
ENGINE_MODES = ("process", "thread")


@dataclass(kw_only=True)
class ServerArgs:
    """Everything about the HTTP side; the engine's knobs stay in EngineArgs.

    ``max_num_queued_requests`` bounds requests in flight (waiting plus
    running), as vLLM's ``max_num_queued_reqs`` does; None picks
    ``max(DEFAULT_QUEUE_FLOOR, DEFAULT_QUEUE_FACTOR * max_num_seqs)`` so memory
    never grows without bound. ``max_num_queued_tokens`` bounds the prompt
    tokens of requests that have not produced their first token yet.
    ``trace_steps`` is how many steps /debug/steps keeps (0 turns tracing off).
    ``engine_mode`` runs the engine loop in its own process (default) or on
    a thread of the server process.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    admission_window_ms: float = 0.0
    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None
    trace_steps: int = 256
    retry_after_s: int = 1
    log_level: str = "info"
    engine_mode: str = "process"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in [0, 65535]")
        if self.admission_window_ms < 0 or self.admission_window_ms != self.admission_window_ms:
            raise ConfigError(f"admission_window_ms={self.admission_window_ms} must be >= 0")
        for name in ("max_num_queued_requests", "max_num_queued_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name}={v} must be a positive integer")
        if self.trace_steps < 0:
            raise ConfigError(f"trace_steps={self.trace_steps} must be >= 0")
        if self.retry_after_s < 1:
            raise ConfigError(f"retry_after_s={self.retry_after_s} must be >= 1")
        if self.api_key == "":
            self.api_key = None
        if self.engine_mode not in ENGINE_MODES:
            raise ConfigError(f"engine_mode={self.engine_mode!r} must be one of {', '.join(ENGINE_MODES)}")

    def queue_limit(self, max_num_seqs: int) -> int:
        """The in-flight request cap in force for an engine with ``max_num_seqs`` slots."""
        if self.max_num_queued_requests is not None:
            return self.max_num_queued_requests
        return max(DEFAULT_QUEUE_FLOOR, DEFAULT_QUEUE_FACTOR * max_num_seqs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the server flags (vLLM's names) to ``parser``."""
        g = parser.add_argument_group("server (vLLM serve arguments)")
        g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        g.add_argument(
            "--port", type=int, default=8000, help="port to bind; 0 picks a free one (default 8000)"
        )
        g.add_argument(
            "--api-key",
            default=None,
            help=f"require 'Authorization: Bearer KEY' on /v1 and /debug (default: ${API_KEY_ENV}, if set)",
        )
        g.add_argument(
            "--served-model-name",
            nargs="+",
            default=[],
            metavar="NAME",
            help="model name(s) clients use; the first is reported (default: --model, or the embedded "
            "model's folder name)",
        )
        g.add_argument(
            "--admission-window-ms",
            type=float,
            default=0.0,
            metavar="MS",
            help="hold new requests back until the oldest of them is this old, then queue them together, "
            "so a burst is admitted in one step; running requests keep stepping (default 0)",
        )
        g.add_argument(
            "--max-num-queued-requests",
            "--max-num-queued-reqs",
            dest="max_num_queued_requests",
            type=int,
            default=None,
            metavar="N",
            help="requests in flight (waiting + running) beyond which new ones get 503 "
            f"(default max({DEFAULT_QUEUE_FLOOR}, {DEFAULT_QUEUE_FACTOR} x --max-num-seqs))",
        )
        g.add_argument(
            "--max-num-queued-tokens",
            type=int,
            default=None,
            metavar="N",
            help="prompt tokens awaiting their first output token beyond which new requests get 503",
        )
        g.add_argument(
            "--trace-steps",
            type=int,
            default=256,
            metavar="N",
            help="decision-trace steps kept for GET /debug/steps (0 turns tracing off; default 256)",
        )
        g.add_argument(
            "--engine-mode",
            choices=ENGINE_MODES,
            default="process",
            help="run the engine loop in its own process (default; HTTP work never shares its interpreter "
            "lock) or on a thread of the server",
        )
        g.add_argument(
            "--log-level",
            default="info",
            choices=["critical", "error", "warning", "info", "debug"],
            help="uvicorn's log level (default info)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """Build from a namespace parsed with ``add_cli_args``'s flags."""
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if kwargs.get("api_key") is None:
            kwargs["api_key"] = os.environ.get(API_KEY_ENV) or None
        return cls(**kwargs)
