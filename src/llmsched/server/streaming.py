"""ASGI responses that notice a client leaving while the engine still works for it.

Both watch the connection for ``http.disconnect`` alongside their work and
call ``on_disconnect`` the moment it comes, so the request is aborted and
its KV blocks freed before the next step, whatever the server's ASGI spec
version or whether a token is due.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from llmsched.server.errors import APIError, error_body


async def _watch(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class EventStreamResponse(Response):
    """Streams server-sent events from ``body`` (bytes chunks)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        # Not Response.__init__: it would add "content-length: 0" for the empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache"})
        self.body_iterator = body
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the events; on disconnect abort and stop at the next chunk."""
        gone = False

        def left() -> None:
            nonlocal gone
            gone = True
            self.on_disconnect()

        watcher = asyncio.ensure_future(_watch(receive, left))
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.body_iterator:
                if gone:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            # The transport broke under a write: the client is gone.
            self.on_disconnect()
        finally:
            watcher.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class DeferredJSONResponse(Response):
    """Answers with the JSON that ``result`` produces, aborting it if the client leaves first."""

    media_type = "application/json"

    def __init__(self, result: Awaitable[dict], on_disconnect: Callable[[], None]) -> None:
        # Headers are written once the status is known, in __call__.
        self.status_code = 200
        self.background = None
        self.result = result
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Await the result while watching the connection, then send it."""
        watcher = asyncio.ensure_future(_watch(receive, self.on_disconnect))
        status = 200
        try:
            body = await self.result
        except APIError as e:
            status, body = e.status, error_body(e.status, e.message, e.param)
        finally:
            watcher.cancel()
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
