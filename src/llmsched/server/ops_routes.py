"""GET /health, /ping, /version, /metrics and /debug/steps: what operators look at."""

from __future__ import annotations

from fastapi import APIRouter, Query
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

import llmsched
from llmsched.server.async_engine import EngineDead
from llmsched.server.errors import APIError
from llmsched.server.state import ServerState

MAX_DEBUG_STEPS = 100_000


def ops_router(state: ServerState) -> APIRouter:
    """Health, Prometheus metrics and the decision trace over ``state``."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        """200 while the engine thread serves requests, else 503."""
        if not state.engine.is_running:
            raise APIError(503, state.engine.dead_reason or "the engine is not running")
        return Response(status_code=200)

    # vLLM answers the load balancers' /ping (GET or POST) exactly as /health.
    for method in ("GET", "POST"):
        router.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}")

    @router.get("/version")
    async def version() -> dict:
        """The server's version."""
        return {"version": llmsched.__version__}

    # async: metrics are only touched on the event loop, so the scrape must run there too.
    @router.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition (vLLM's metric names)."""
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/debug/steps")
    async def debug_steps(
        last: int = Query(10, ge=1, le=MAX_DEBUG_STEPS, description="how many of the latest steps"),
        explain: bool = Query(False, description="add each step's human-readable explanation"),
        rank: int | None = Query(None, ge=0, description="data parallelism: only this rank's steps"),
    ) -> dict:
        """The latest engine steps: what ran, what was admitted, preempted, aborted, and why.

        With data parallelism every record names its ``rank``; without ``rank``
        the latest ``last`` steps of all ranks, by time.
        """
        num_ranks = state.args.data_parallel_size
        if rank is not None and rank >= num_ranks:
            raise APIError(
                400, f"rank={rank}: the server runs {num_ranks} data-parallel rank(s), 0 to {num_ranks - 1}"
            )
        try:
            steps = await state.engine.steps(last, explain, None if num_ranks == 1 else rank)
        except (EngineDead, TimeoutError) as e:
            raise APIError(503, f"the engine did not answer: {e}") from None
        return {"trace_steps": state.engine.info.trace_steps, "steps": steps}

    return router
