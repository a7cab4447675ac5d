"""The server's own settings (host, port, API key, queue limits), with vLLM's flag names."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from llmsched.core.errors import ConfigError
from llmsched.engine.chat_template import load_chat_template
from llmsched.server.dp_args import DEFAULT_JOIN_TIMEOUT_S, add_dp_serve_args, check_dp_serve
from llmsched.server.lora_modules import LoRAModule, parse_lora_module

# With no --max-num-queued-requests the queue is still bounded: this many
# in-flight requests per sequence slot, and never fewer than the floor.
DEFAULT_QUEUE_FACTOR = 4
DEFAULT_QUEUE_FLOOR = 1024
API_KEY_ENV = "LLMSCHED_API_KEY"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_LOGPROBS = 20
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_STRING_LEN = 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
ENGINE_MODES = ("process", "thread")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
    # One key, or several (any of them is accepted, as vLLM's --api-key k1 k2).
    api_key: str | list[str] | None = None
    served_model_name: list[str] = field(default_factory=list)
    # Adapters offered from the start (they need --enable-lora).
    lora_modules: list[LoRAModule] = field(default_factory=list)
    admission_window_ms: float = 0.0
    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None
    trace_steps: int = 256
    retry_after_s: int = 1
    log_level: str = "info"
    engine_mode: str = "process"
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_len: int = DEFAULT_MAX_STOP_STRING_LEN
    request_timeout_s: float | None = None
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    # Touch the whole CPU KV cache before serving, so no step pays its first
    # page faults (on by default from the command line; off here so that
    # engines built in-process for tests start at once).
    prefault_kv_cache: bool = False
    # Hosts whose http(s) image URLs the server may fetch (none: data: URLs only).
    allowed_media_domains: list[str] = field(default_factory=list)
    # The chat template used instead of the model's: a file's path or the template's text.
    chat_template: str | None = None
    # Data parallelism (vLLM's flags; server/dp_args.py says which settings run).
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    data_parallel_backend: str = "mp"
    headless: bool = False
    api_server_count: int | None = None
    data_parallel_join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S

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
        if isinstance(self.api_key, (list, tuple)):
            keys = [k for k in self.api_key if k]
            self.api_key = keys[0] if len(keys) == 1 else (keys or None)
        if self.api_key == "":
            self.api_key = None
        self._check_limits()
        self.log_level = self.log_level.lower()
        self.chat_template = load_chat_template(self.chat_template)
        if self.engine_mode not in ENGINE_MODES:
            raise ConfigError(f"engine_mode={self.engine_mode!r} must be one of {', '.join(ENGINE_MODES)}")
        check_dp_serve(self)

    def _check_limits(self) -> None:
        if not 0.0 < self.kv_cache_metrics_sample <= 1.0:
            raise ConfigError(f"kv_cache_metrics_sample={self.kv_cache_metrics_sample} must be in (0, 1]")
        for name in ("max_request_body_bytes", "max_stop_strings", "max_stop_string_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive integer")
        if not 0 <= self.max_logprobs <= DEFAULT_MAX_LOGPROBS:
            raise ConfigError(f"max_logprobs={self.max_logprobs} must be in [0, {DEFAULT_MAX_LOGPROBS}]")
        t = self.request_timeout_s
        if t is not None and not t > 0:
            raise ConfigError(f"request_timeout_s={t} must be > 0")
        if not self.shutdown_timeout_s >= 0:
            raise ConfigError(f"shutdown_timeout_s={self.shutdown_timeout_s} must be >= 0")

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
            nargs="+",
            default=None,
            metavar="KEY",
            help=f"require 'Authorization: Bearer KEY' on /v1 and /debug, KEY one of those given "
            f"(default: ${API_KEY_ENV}, if set)",
        )
        g.add_argument(
            "--allowed-media-domains",
            nargs="+",
            default=[],
            metavar="HOST",
            help="hosts whose http(s) image URLs chat requests may name (default: none; images come "
            "as data: URLs)",
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
            "--lora-modules",
            nargs="+",
            default=[],
            type=_lora_module,
            metavar="NAME=PATH",
            help="LoRA adapters (local PEFT folders) served from the start; a request picks one by naming "
            "it in 'model'. Also JSON: '{\"name\": ..., \"path\": ...}'. Needs --enable-lora",
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
            "--prefault-kv-cache",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="write the whole KV cache once at startup, so no serving step pays its first page faults "
            "(default on; a CPU cache starts lazily mapped)",
        )
        _add_observability_args(g)
        _add_hardening_args(g)
        g.add_argument(
            "--chat-template",
            default=None,
            metavar="FILE|TEMPLATE",
            help="the Jinja chat template for chat requests instead of the model's: a file, or the "
            "template's text (as vLLM)",
        )
        add_dp_serve_args(parser)
        g.add_argument(
            "--log-level",
            "--uvicorn-log-level",
            default="info",
            type=_log_level,
            choices=LOG_LEVELS,
            help="uvicorn's log level (default info; any case)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """Build from a namespace parsed with ``add_cli_args``'s flags."""
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if kwargs.get("api_key") is None:
            kwargs["api_key"] = os.environ.get(API_KEY_ENV) or None
        return cls(**kwargs)


def _log_level(text: str) -> str:
    """A log level in any case; vLLM's NOTSET (log everything) is uvicorn's most detailed standard one."""
    level = text.lower()
    return "debug" if level == "notset" else level


def _lora_module(text: str) -> LoRAModule:
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_observability_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--kv-cache-metrics",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="sample KV block residency for /metrics (vllm:kv_block_lifetime_seconds, "
        "vllm:kv_block_idle_before_evict_seconds, vllm:kv_block_reuse_gap_seconds)",
    )
    g.add_argument(
        "--kv-cache-metrics-sample",
        type=float,
        default=0.01,
        metavar="FRACTION",
        help="fraction of block lives --kv-cache-metrics follows (default 0.01, as vLLM)",
    )


def _add_hardening_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help=f"request bodies larger than this get 413 before they are read whole "
        f"(default {DEFAULT_MAX_BODY_BYTES})",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=DEFAULT_MAX_LOGPROBS,
        metavar="N",
        help=f"most logprobs / top_logprobs a request may ask for; more get 400 "
        f"(default and ceiling {DEFAULT_MAX_LOGPROBS})",
    )
    g.add_argument(
        "--max-stop-strings",
        type=int,
        default=DEFAULT_MAX_STOP_STRINGS,
        metavar="N",
        help=f"most stop strings per request; more get 400 (default {DEFAULT_MAX_STOP_STRINGS})",
    )
    g.add_argument(
        "--max-stop-string-len",
        type=int,
        default=DEFAULT_MAX_STOP_STRING_LEN,
        metavar="CHARS",
        help=f"longest stop string; longer get 400 (default {DEFAULT_MAX_STOP_STRING_LEN})",
    )
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        metavar="S",
        help="abort a request (freeing its KV blocks) once it has run this long; the client gets "
        "a 504, or an error event on a stream (default: no limit)",
    )
    g.add_argument(
        "--shutdown-timeout-s",
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help="on SIGTERM or Ctrl-C stop accepting, let requests in flight finish for this long, then "
        f"abort the rest with a clean answer and exit (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
