"""The API-key check: one key or several, as vLLM's --api-key takes them."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from llmsched.cli import build_parser
from llmsched.server.args import ServerArgs
from llmsched.server.auth import APIKeyMiddleware


def client(api_key: str | list[str]) -> TestClient:
    """A one-route app behind the key check."""
    app = Starlette(routes=[Route("/v1/models", lambda request: PlainTextResponse("ok"))])
    app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return TestClient(app)


def status(c: TestClient, key: str) -> int:
    return c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code


def test_any_of_several_keys_is_accepted_and_no_other() -> None:
    args = ServerArgs.from_cli_args(build_parser().parse_args(["serve", "--api-key", "k1", "k2"]))
    assert args.api_key == ["k1", "k2"]
    c = client(args.api_key)
    assert (status(c, "k1"), status(c, "k2"), status(c, "k3")) == (200, 200, 401)
    assert c.get("/v1/models", headers={"x-api-key": "k2"}).status_code == 200


def test_one_key_stays_a_string() -> None:
    args = ServerArgs.from_cli_args(build_parser().parse_args(["serve", "--api-key", "k"]))
    assert args.api_key == "k"
    assert (status(client("k"), "k"), status(client("k"), "kk")) == (200, 401)
