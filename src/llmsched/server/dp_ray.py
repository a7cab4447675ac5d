"""`--data-parallel-backend ray`: every data-parallel rank a Ray actor, placed by the Ray cluster.

The API server joins the Ray cluster (``RAY_ADDRESS``, a running local
cluster, or a new local one: ``ray.init()``'s rules), reserves one bundle
per rank in a placement group (a CPU each, and a GPU each when the engine
runs on CUDA) and starts one actor per bundle. Each actor runs the
ordinary engine loop and joins the API server over an authenticated TCP
link (``dp_link``) with a key the server made for this run, exactly as a
``--headless`` rank does; from then on the API server treats it as any
remote rank. An actor that dies closes its link, which the API server
notices at once.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.server.dp_args import DPLayout
from llmsched.server.dp_link import HANDSHAKE_S, connect, join, listen
from llmsched.server.dp_remote import RemoteRank, accept_ranks


class RankActor:
    """One rank inside a Ray actor: join the API server, then serve its commands until Stop."""

    def run(
        self, address: str, port: int, key: bytes, rank: int, size: int, engine_args: EngineArgs, opts: dict
    ) -> None:
        """Serve rank ``rank`` for the API server at ``address:port``; returns when it stops."""
        from llmsched.server.process_backend import run_engine

        link = connect(address, port, key, time.monotonic() + 3 * HANDSHAKE_S)
        join(link, rank, size, f"Ray actor, process {os.getpid()} on {socket.gethostname()}")
        try:
            run_engine(link.conn, engine_args, **opts)
        finally:
            link.close()


class RayRanks:
    """The actors and placement group of a run, released by ``release``."""

    def __init__(self, ray: Any, owns_ray: bool) -> None:
        self.ray = ray
        self.owns_ray = owns_ray
        self.group: Any = None
        self.actors: list[Any] = []
        self.runs: list[Any] = []

    def failure(self) -> str | None:
        """A rank's actor that ended before joining, with Ray's reason, if any."""
        done, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            rank = self.runs.index(ref)
            try:
                self.ray.get(ref)
            except Exception as e:
                return f"rank {rank}'s Ray actor failed: {type(e).__name__}: {e}"
            return f"rank {rank}'s Ray actor ended before joining"
        return None

    def release(self) -> None:
        """Kill the actors, free their bundles, and leave Ray if this server started it."""
        for a in self.actors:
            with contextlib.suppress(Exception):  # an actor already gone
                self.ray.kill(a)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        if self.owns_ray:
            self.ray.shutdown()


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--data-parallel-backend ray needs Ray: pip install ray") from None
    return ray


def _place(placed: RayRanks, engine_args: EngineArgs, size: int, timeout_s: float) -> None:
    """Reserve one bundle per rank; ConfigError if the cluster cannot hold them in time."""
    from ray.util.placement_group import placement_group

    bundle = {"CPU": 1.0}
    if str(engine_args.device).startswith("cuda"):
        bundle["GPU"] = 1.0
    placed.group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
    try:
        placed.ray.get(placed.group.ready(), timeout=timeout_s)
    except placed.ray.exceptions.GetTimeoutError:
        raise ConfigError(
            f"the Ray cluster found no room for {size} data-parallel ranks of {bundle} within "
            f"{timeout_s:g} s (--data-parallel-join-timeout); resources: {placed.ray.cluster_resources()}"
        ) from None


def start_ray_ranks(
    engine_args: EngineArgs, layout: DPLayout, opts: dict
) -> tuple[list[RemoteRank], Callable[[], None]]:
    """Start every rank as a Ray actor and accept their joins; returns them and the release function."""
    ray = _import_ray()
    placed = RayRanks(ray, owns_ray=not ray.is_initialized())
    if placed.owns_ray:
        ray.init()
    try:
        if engine_args.num_threads is None:
            engine_args = replace(engine_args, num_threads=1)  # a bundle's CPU
        address = layout.address or ray.util.get_node_ip_address()
        server = listen(address, layout.port)
        key = secrets.token_bytes(32)
        try:
            _place(placed, engine_args, layout.size, layout.join_timeout_s)
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            actor_cls = ray.remote(RankActor)
            port = server.getsockname()[1]
            for r in range(layout.size):
                strategy = PlacementGroupSchedulingStrategy(placed.group, placement_group_bundle_index=r)
                actor = actor_cls.options(scheduling_strategy=strategy, num_cpus=1).remote()
                placed.actors.append(actor)
                placed.runs.append(actor.run.remote(address, port, key, r, layout.size, engine_args, opts))
            joined = accept_ranks(
                server,
                key,
                range(layout.size),
                layout.size,
                layout.join_timeout_s,
                "the Ray actors did not connect (see the Ray logs; can the Ray nodes reach "
                f"{address}:{port}? set --data-parallel-address)",
                watch=placed.failure,
            )
        finally:
            server.close()
    except BaseException:
        placed.release()
        raise
    return [joined[r] for r in range(layout.size)], placed.release
