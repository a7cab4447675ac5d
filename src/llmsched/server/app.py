"""The FastAPI application: routes, error handlers, API key, and the engine thread's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import llmsched
from llmsched.core.errors import ConfigError
from llmsched.server.auth import APIKeyMiddleware
from llmsched.server.body_limit import BodyLimitMiddleware
from llmsched.server.errors import APIError, install_error_handlers
from llmsched.server.lora_routes import load_adapter, lora_router
from llmsched.server.openai_routes import openai_router
from llmsched.server.ops_routes import ops_router
from llmsched.server.session_routes import session_router
from llmsched.server.state import ServerState
from llmsched.server.tokenize_routes import tokenize_router


def build_app(state: ServerState) -> FastAPI:
    """An app serving ``state``; the engine thread starts and stops with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            # --lora-modules: a bad adapter stops the server from starting, naming it.
            for m in state.args.lora_modules:
                try:
                    await load_adapter(state, m.name, m.path)
                except APIError as e:
                    raise ConfigError(f"--lora-modules {m.name}={m.path}: {e.message}") from None
            yield
        finally:
            await state.engine.stop()

    app = FastAPI(
        title="llmsched",
        version=llmsched.__version__,
        description="OpenAI-compatible API of the llmsched serving engine",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.include_router(openai_router(state))
    app.include_router(ops_router(state))
    app.include_router(tokenize_router(state))
    app.include_router(session_router(state))
    if state.loras is not None:
        app.include_router(lora_router(state))
    if state.args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.args.api_key)
    # Added last, so it runs first: an oversized body is refused before anything reads it.
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.args.max_request_body_bytes)
    app.state.llmsched = state
    return app
