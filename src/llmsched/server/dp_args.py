"""`llmsched serve`'s data-parallel flags, under vLLM's names, and what this version can run of them.

One host, one API server, ``--data-parallel-size N`` engine processes
(the ``mp`` backend) is implemented. Ranks on other hosts (``--headless``,
``--data-parallel-size-local`` below N, ``--data-parallel-start-rank``, a
non-loopback ``--data-parallel-address``), the ``ray`` backend and more
than one API server are parsed with vLLM's meanings and refused with a
message saying they are not available yet, never silently ignored.
"""

from __future__ import annotations

import argparse
from typing import Protocol

from llmsched.core.errors import ConfigError

DP_BACKENDS = ("mp", "ray")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_NOT_YET = "is not available yet: this version serves data-parallel ranks on one host only"


def add_dp_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add vLLM's data-parallel serving flags to ``parser``."""
    g = parser.add_argument_group("data parallelism (vLLM serve arguments)")
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine processes (ranks), each with its own scheduler and KV cache; the API server "
        "routes each new request to the least-loaded rank (default 1)",
    )
    g.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        type=int,
        default=None,
        help="ranks started on this host (default: all of them; fewer needs --headless hosts, not yet)",
    )
    g.add_argument(
        "--data-parallel-start-rank",
        "-dpr",
        type=int,
        default=None,
        help="the first rank on this host (default 0; others need several hosts, not yet)",
    )
    g.add_argument(
        "--data-parallel-address",
        "-dpa",
        default=None,
        help="where the ranks meet (default loopback; another host's address is not available yet)",
    )
    g.add_argument(
        "--data-parallel-rpc-port",
        "-dpp",
        type=int,
        default=None,
        help="the ranks' meeting port (unused while every rank runs here)",
    )
    g.add_argument(
        "--data-parallel-backend",
        "-dpb",
        default="mp",
        help="mp: engine processes started here (default); ray: placed by Ray (not available yet)",
    )
    g.add_argument(
        "--headless",
        action="store_true",
        default=False,
        help="run ranks without an API server, joining one on another host (not available yet)",
    )
    g.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=None,
        help="API server processes (default 1; more is not available yet)",
    )


class DPServeSettings(Protocol):
    """The data-parallel settings ``check_dp_serve`` reads (``ServerArgs`` has them all)."""

    engine_mode: str
    data_parallel_size: int
    data_parallel_size_local: int | None
    data_parallel_start_rank: int | None
    data_parallel_address: str | None
    data_parallel_rpc_port: int | None
    data_parallel_backend: str
    headless: bool
    api_server_count: int | None


def check_dp_serve(args: DPServeSettings) -> None:
    """Refuse data-parallel settings this version cannot run, naming the flag (ConfigError)."""
    n = args.data_parallel_size
    if n < 1:
        raise ConfigError(f"--data-parallel-size {n} must be a positive integer")
    if args.data_parallel_backend not in DP_BACKENDS:
        raise ConfigError(
            f"--data-parallel-backend {args.data_parallel_backend!r} must be one of {', '.join(DP_BACKENDS)}"
        )
    if args.headless:
        raise ConfigError(f"--headless {_NOT_YET} (start every rank with this server instead)")
    if args.data_parallel_backend == "ray":
        raise ConfigError(f"--data-parallel-backend ray {_NOT_YET}; use mp (the default)")
    local = args.data_parallel_size_local
    if local is not None and local != n:
        raise ConfigError(
            f"--data-parallel-size-local {local} with --data-parallel-size {n} {_NOT_YET}; "
            "leave it out to start every rank here"
        )
    start = args.data_parallel_start_rank
    if start not in (None, 0):
        raise ConfigError(f"--data-parallel-start-rank {start} {_NOT_YET}; leave it out")
    addr = args.data_parallel_address
    if addr is not None and addr not in LOOPBACK:
        raise ConfigError(f"--data-parallel-address {addr} {_NOT_YET}; leave it out")
    port = args.data_parallel_rpc_port
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"--data-parallel-rpc-port {port} must be in [0, 65535]")
    count = args.api_server_count
    if count is not None and count < 1:
        raise ConfigError(f"--api-server-count {count} must be a positive integer")
    if count is not None and count > 1:
        raise ConfigError(
            f"--api-server-count {count} is not available yet: one API server process routes every "
            "request (leave the flag out)"
        )
    if n > 1 and args.engine_mode != "process":
        raise ConfigError(
            f"--data-parallel-size {n} runs each rank in a process of its own; it cannot go with "
            f"--engine-mode {args.engine_mode}"
        )
