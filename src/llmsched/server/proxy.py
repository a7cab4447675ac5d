"""`llmsched proxy`: one OpenAI-compatible front for a prefill instance and a decode instance.

Each completion goes first to a prefill instance with ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": true}`` (it computes the prompt
and keeps its KV blocks), then to a decode instance with the
``kv_transfer_params`` the prefill answered (it loads those blocks instead
of computing the prompt); the decode side's answer, streamed or not, is the
client's. As vLLM's P/D proxy does. Several instances of a side take turns.
An instance that cannot be reached is a 503 naming it, at once; one that
stops answering mid-stream ends the stream with an error event.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

log = logging.getLogger(__name__)
# Connecting to a live instance on a local network takes milliseconds.
CONNECT_TIMEOUT_S = 3.0


class ProxyError(Exception):
    """An instance failed; ``status`` and the message go to the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error_body(status: int, message: str) -> dict:
    kind = "ServiceUnavailableError" if status == 503 else "BadRequestError"
    return {"error": {"message": message, "type": kind, "code": status}}


class PDProxy:
    """Routes each request through a prefill instance, then a decode instance."""

    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float) -> None:
        import httpx

        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(self.prefill)
        self._next_decode = itertools.cycle(self.decode)
        timeout = httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))

    async def close(self) -> None:
        """Close the HTTP client."""
        await self.client.aclose()

    async def _prefill(self, path: str, body: dict, request_id: str) -> dict[str, Any]:
        """Run the prompt on a prefill instance; returns its kv_transfer_params."""
        import httpx

        url = next(self._next_prefill)
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pre["max_tokens"] = 1
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        try:
            r = await self.client.post(url + path, json=pre, headers={"X-Request-Id": request_id})
        except httpx.HTTPError as e:
            raise ProxyError(
                503, f"the prefill instance {url} is not answering: {type(e).__name__}: {e}"
            ) from None
        if r.status_code != 200:
            raise ProxyError(r.status_code, _message(r, f"the prefill instance {url}"))
        params = r.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            raise ProxyError(
                503, f"the prefill instance {url} returned no kv_transfer_params (is it a kv_producer?)"
            )
        return params

    async def forward(self, path: str, body: dict) -> tuple[int, Any, AsyncIterator[bytes] | None]:
        """(status, JSON body, None) or (200, None, a byte stream) for one completion request."""
        import httpx

        request_id = f"pd-{uuid.uuid4().hex}"
        params = await self._prefill(path, body, request_id)
        url = next(self._next_decode)
        dec = {**body, "kv_transfer_params": params}
        req = self.client.build_request("POST", url + path, json=dec, headers={"X-Request-Id": request_id})
        try:
            r = await self.client.send(req, stream=bool(body.get("stream")))
        except httpx.HTTPError as e:
            raise ProxyError(
                503, f"the decode instance {url} is not answering: {type(e).__name__}: {e}"
            ) from None
        if not body.get("stream") or r.status_code != 200:
            if body.get("stream"):
                await r.aread()
                await r.aclose()
            if r.status_code != 200:
                raise ProxyError(r.status_code, _message(r, f"the decode instance {url}"))
            return 200, r.json(), None
        return 200, None, self._relay(r, url)

    async def _relay(self, r: Any, url: str) -> AsyncIterator[bytes]:
        import httpx

        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            msg = f"the decode instance {url} stopped answering: {type(e).__name__}: {e}"
            yield f"data: {json.dumps(_error_body(503, msg))}\n\ndata: [DONE]\n\n".encode()
        finally:
            await r.aclose()

    async def health(self) -> tuple[int, dict]:
        """200 when every instance answers /health, else 503 naming those that do not."""
        import httpx

        down = []
        for url in self.prefill + self.decode:
            try:
                r = await self.client.get(url + "/health", timeout=CONNECT_TIMEOUT_S)
                if r.status_code != 200:
                    down.append(f"{url} ({r.status_code})")
            except httpx.HTTPError as e:
                down.append(f"{url} ({type(e).__name__})")
        if down:
            return 503, _error_body(503, "instances not healthy: " + ", ".join(down))
        return 200, {"status": "ok"}


def _message(r: Any, who: str) -> str:
    try:
        detail = r.json().get("error", {}).get("message") or r.text
    except (ValueError, AttributeError):
        detail = r.text
    return f"{who} answered {r.status_code}: {detail}"


def build_app(proxy: PDProxy) -> Any:
    """The proxy's Starlette app: the two completion endpoints, /health and /v1/models."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completion(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(_error_body(400, "the body is not JSON"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(_error_body(400, "the body must be a JSON object"), status_code=400)
        try:
            status, data, stream = await proxy.forward(request.url.path, body)
        except ProxyError as e:
            return JSONResponse(_error_body(e.status, str(e)), status_code=e.status)
        if stream is not None:
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse(data, status_code=status)

    async def health(_: Request) -> Any:
        status, data = await proxy.health()
        return JSONResponse(data, status_code=status)

    async def models(_: Request) -> Any:
        import httpx

        url = proxy.decode[0]
        try:
            r = await proxy.client.get(url + "/v1/models", timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError as e:
            return JSONResponse(
                _error_body(503, f"the decode instance {url} is not answering: {e}"), status_code=503
            )
        return JSONResponse(r.json(), status_code=r.status_code)

    routes = [
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/chat/completions", completion, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        yield
        await proxy.close()

    return Starlette(routes=routes, lifespan=lifespan)


def add_proxy_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `proxy` subcommand on ``sub``."""
    p = sub.add_parser(
        "proxy",
        help="an OpenAI-compatible front for disaggregated prefill and decode instances",
        description="Send each completion to a prefill instance (max_tokens 1, kv_transfer_params "
        '{"do_remote_decode": true}), then to a decode instance with the kv_transfer_params it '
        "returned, and answer with the decode side's response (streamed when asked). Start the "
        'instances with llmsched serve --kv-transfer-config \'{"kv_connector": "MooncakeConnector", '
        '"kv_role": "kv_producer"}\' (prefill) and "kv_role": "kv_consumer" (decode). An instance '
        "that cannot be reached makes a 503.",
    )
    p.add_argument(
        "--prefill", action="append", required=True, metavar="URL", help="a prefill instance (repeatable)"
    )
    p.add_argument(
        "--decode", action="append", required=True, metavar="URL", help="a decode instance (repeatable)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait on an instance's answer (default 600)",
    )
    p.set_defaults(func=run_proxy)
    return p


def run_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until interrupted."""
    import uvicorn

    app = build_app(PDProxy(args.prefill, args.decode, args.timeout))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
