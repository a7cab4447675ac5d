"""API-key check for /v1 and /debug, WebSocket sessions included (health and metrics stay open, as in vLLM).

A pure ASGI middleware rather than Starlette's BaseHTTPMiddleware, which
would wrap every streamed chunk of every response in extra tasks.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from llmsched.server.errors import error_body

PROTECTED_PREFIXES = ("/v1", "/debug")


class APIKeyMiddleware:
    """Answers 401 unless ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) carries one of the keys."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str]) -> None:
        self.app = app
        self._keys = [k.encode() for k in ([api_key] if isinstance(api_key, str) else api_key)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the key on protected HTTP paths, then pass the request on."""
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if not path.startswith(PROTECTED_PREFIXES) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            # Closing before accepting refuses the handshake (HTTP 403).
            await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
            return
        body = json.dumps(
            error_body(401, "invalid or missing API key (send 'Authorization: Bearer KEY')")
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and self._known(token.strip()):
                    return True
            elif name == b"x-api-key" and self._known(value.strip()):
                return True
        return False

    def _known(self, token: bytes) -> bool:
        # Every key is compared, so the time taken does not tell which one came close.
        return sum(hmac.compare_digest(token, k) for k in self._keys) > 0
