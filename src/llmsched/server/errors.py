"""Errors in OpenAI's JSON shape, and the handlers that make every failure one.

Body: ``{"error": {"message", "type", "param", "code"}}`` with vLLM's type
names and the HTTP status as ``code``. Whatever escapes a handler becomes a
JSON error here: FastAPI's 422 validation errors are 400s, as in vLLM and
OpenAI, and an unexpected exception is a logged 500 rather than a dropped
connection.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

log = logging.getLogger("llmsched.server")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "PayloadTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error to answer with; ``param`` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The OpenAI-shaped error object."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    """The JSON response for ``err``."""
    return JSONResponse(error_body(err.status, err.message, err.param), err.status, headers=err.headers)


def sse_error(status: int, message: str) -> bytes:
    """An error sent inside an event stream that already started."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"


def _param_of(loc: tuple) -> str | None:
    # ("body", "messages", 0, "content") -> "messages"; FastAPI puts the part first.
    parts = [str(p) for p in loc[1:] if not isinstance(p, int)]
    return parts[0] if parts else None


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = tuple(first.get("loc", ()))
        where = ".".join(str(p) for p in loc[1:]) or "body"
        if first.get("type") == "json_invalid" or loc == ("body",):
            message = f"the request body is not a valid JSON object: {first.get('msg', 'invalid')}"
        else:
            message = f"{where}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return error_response(APIError(400, message, _param_of(loc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while handling a request")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))
