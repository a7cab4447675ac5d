"""`llmsched serve`'s data-parallel flags, under vLLM's names and meanings.

One API server routes to every rank (vLLM's internal load balancing):
``--data-parallel-size N`` ranks, ``--data-parallel-size-local`` of them
started on the API server's host (the ``mp`` backend) and the rest by
``--headless`` processes on other hosts, each starting ranks
``--data-parallel-start-rank`` on, which join the API server at
``--data-parallel-address:--data-parallel-rpc-port``; or every rank placed
by Ray (``--data-parallel-backend ray``). vLLM's hybrid load balancing (a
start rank on an API server's host) and more than one API server process
are refused with a message naming the flag, never silently ignored.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Protocol

from llmsched.core.errors import ConfigError

DP_BACKENDS = ("mp", "ray")
DEFAULT_JOIN_TIMEOUT_S = 600.0  # as vLLM waits for its engines (VLLM_ENGINE_READY_TIMEOUT_S)


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
        help="ranks started on this host (default: all of them); on the API server's host the others "
        "join from --headless hosts",
    )
    g.add_argument(
        "--data-parallel-start-rank",
        "-dpr",
        type=int,
        default=None,
        help="with --headless: the first rank this host starts (default 0)",
    )
    g.add_argument(
        "--data-parallel-address",
        "-dpa",
        default=None,
        help="the API server's address for ranks on other hosts: it listens there, --headless hosts connect "
        "there (default 127.0.0.1; with ray, this host's address)",
    )
    g.add_argument(
        "--data-parallel-rpc-port",
        "-dpp",
        type=int,
        default=None,
        help="the port of --data-parallel-address (default 29550; with ray, a free one)",
    )
    g.add_argument(
        "--data-parallel-backend",
        "-dpb",
        default="mp",
        help="mp: engine processes started here and by --headless hosts (default); ray: Ray actors "
        "placed on the Ray cluster (RAY_ADDRESS, or a local one)",
    )
    g.add_argument(
        "--headless",
        action="store_true",
        default=False,
        help="run this host's ranks without an API server: they join the one at --data-parallel-address",
    )
    g.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=None,
        help="API server processes (default 1; 0 means --headless, as in vLLM; more is not available)",
    )
    g.add_argument(
        "--data-parallel-join-timeout",
        type=float,
        default=DEFAULT_JOIN_TIMEOUT_S,
        dest="data_parallel_join_timeout_s",
        help="seconds the API server waits for ranks on other hosts to join, and a --headless host for "
        f"the API server to answer (default {DEFAULT_JOIN_TIMEOUT_S:g})",
    )


@dataclass(frozen=True, slots=True)
class DPLayout:
    """Where the ranks run: ``local`` started here, the rest joining at ``address:port``."""

    size: int
    local: int
    start_rank: int = 0
    backend: str = "mp"
    address: str = "127.0.0.1"
    port: int = 29550
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S


class DPServeSettings(Protocol):
    """The data-parallel settings this module reads (``ServerArgs`` has them all)."""

    engine_mode: str
    data_parallel_size: int
    data_parallel_size_local: int | None
    data_parallel_start_rank: int | None
    data_parallel_address: str | None
    data_parallel_rpc_port: int | None
    data_parallel_backend: str
    data_parallel_join_timeout_s: float
    headless: bool
    api_server_count: int | None


def dp_layout(args: DPServeSettings) -> DPLayout:
    """The ranks' layout the (checked) flags ask for."""
    from llmsched.server.dp_link import DEFAULT_ADDRESS, DEFAULT_RPC_PORT

    n = args.data_parallel_size
    ray = args.data_parallel_backend == "ray"
    return DPLayout(
        size=n,
        local=0 if ray else n if args.data_parallel_size_local is None else args.data_parallel_size_local,
        start_rank=args.data_parallel_start_rank or 0,
        backend=args.data_parallel_backend,
        # Empty: Ray's address of this node (dp_ray).
        address=args.data_parallel_address or ("" if ray else DEFAULT_ADDRESS),
        port=args.data_parallel_rpc_port or (0 if ray else DEFAULT_RPC_PORT),
        join_timeout_s=args.data_parallel_join_timeout_s,
    )


def check_dp_serve(args: DPServeSettings) -> None:
    """Refuse data-parallel settings that are out of range or not available, naming the flag (ConfigError)."""
    n = args.data_parallel_size
    if n < 1:
        raise ConfigError(f"--data-parallel-size {n} must be a positive integer")
    if args.data_parallel_backend not in DP_BACKENDS:
        raise ConfigError(
            f"--data-parallel-backend {args.data_parallel_backend!r} must be one of {', '.join(DP_BACKENDS)}"
        )
    port = args.data_parallel_rpc_port
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"--data-parallel-rpc-port {port} must be in [1, 65535]")
    if not args.data_parallel_join_timeout_s > 0:
        raise ConfigError(f"--data-parallel-join-timeout {args.data_parallel_join_timeout_s} must be > 0")
    _check_api_servers(args)
    if args.data_parallel_backend == "ray":
        _check_ray(args)
    elif args.headless:
        _check_headless(args)
    else:
        _check_api_host(args)
    if (n > 1 or args.headless or args.data_parallel_backend == "ray") and args.engine_mode != "process":
        raise ConfigError(
            f"--data-parallel-size {n} runs each rank in a process of its own; it cannot go with "
            f"--engine-mode {args.engine_mode}"
        )


def _check_api_servers(args: DPServeSettings) -> None:
    count = args.api_server_count
    if count is None:
        return
    if count < 0:
        raise ConfigError(f"--api-server-count {count} must be >= 0")
    if args.headless and count > 0:
        raise ConfigError(f"--api-server-count {count} cannot go with --headless (it starts no API server)")
    if count == 0:
        args.headless = True  # as vLLM: no API server means a headless host
    elif count > 1:
        raise ConfigError(
            f"--api-server-count {count} is not available: one API server process routes every "
            "request to every rank (leave the flag out)"
        )


def _check_ray(args: DPServeSettings) -> None:
    if args.headless:
        raise ConfigError(
            "--headless cannot go with --data-parallel-backend ray: Ray places every rank (join the other "
            "hosts to the Ray cluster with `ray start --address=HEAD:6379` instead)"
        )
    for flag, value in (
        ("--data-parallel-size-local", args.data_parallel_size_local),
        ("--data-parallel-start-rank", args.data_parallel_start_rank),
    ):
        if value is not None:
            raise ConfigError(
                f"{flag} {value} cannot go with --data-parallel-backend ray: Ray places every rank"
            )


def _check_headless(args: DPServeSettings) -> None:
    n = args.data_parallel_size
    local = n if args.data_parallel_size_local is None else args.data_parallel_size_local
    start = args.data_parallel_start_rank or 0
    if local < 1:
        raise ConfigError(f"--data-parallel-size-local {local} must be >= 1 with --headless")
    if start < 0 or start + local > n:
        raise ConfigError(
            f"--data-parallel-start-rank {start} with --data-parallel-size-local {local} names ranks "
            f"{start}..{start + local - 1}, beyond --data-parallel-size {n} (ranks 0..{n - 1})"
        )


def _check_api_host(args: DPServeSettings) -> None:
    n = args.data_parallel_size
    local = args.data_parallel_size_local
    if local is not None and not 1 <= local <= n:
        raise ConfigError(
            f"--data-parallel-size-local {local} must be in [1, {n}] on the API server's host (it runs "
            "rank 0 and the tokenizer; --headless hosts run the others)"
        )
    start = args.data_parallel_start_rank
    # vLLM reads a start rank on an API server's host as hybrid load balancing, except on one host.
    if start not in (None, 0) or (start == 0 and local not in (None, n)):
        raise ConfigError(
            f"--data-parallel-start-rank {start} without --headless asks for vLLM's hybrid load balancing "
            "(an API server per host), which is not available: this API server starts ranks from 0 and "
            "routes to every rank; give the start rank to the --headless hosts"
        )
