"""The app factory: `create_app(settings)` builds one FastAPI app with its own state and metrics registry.

No module-level app and no globals: tests and tools may build several apps in one process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from service import __version__
from service.api.errors import install_error_handlers
from service.api.middleware import BodyLimitMiddleware, RequestMetricsMiddleware
from service.api.openapi import install_openapi
from service.api.request_id import RequestIdMiddleware
from service.api.responses_api import ResponseStore
from service.api.routers import (
    admin,
    completions,
    health,
    metrics,
    models,
    ocm,
    playground,
    responses,
    tokenize,
)
from service.api.state import ServiceState
from service.config import Settings
from service.runtime import Runtime

DESCRIPTION = """An OpenAI-compatible LLM service with Calibrated Speculative Decoding (CSD, arXiv 2604.13634).

The `speculative` request object overrides the server's speculation settings per request; every response
carries `speculative` statistics next to `usage`. Errors use OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`."""


def create_app(
    settings: Settings,
    runtime: Runtime | None = None,
    *,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """An app serving `settings`. With `runtime`, it serves that (already loaded) runtime; without, the
    lifespan loads one in a background thread. `on_fatal(message)` is called if loading fails."""
    state = ServiceState(settings, runtime, on_fatal=on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="csd-serve", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.csd = state
    app.state.responses = ResponseStore(settings.responses_store_size)  # for previous_response_id
    install_error_handlers(app)
    install_openapi(app)
    routers = [
        module.router
        for module in (completions, responses, models, tokenize, health, metrics, ocm, playground, admin)
    ]
    for router in routers:
        app.include_router(router)
    # add_middleware wraps: the last added runs first, so the metrics middleware sees every response,
    # 413s from the body limit included.
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s
    )
    paths = frozenset(route.path for router in routers for route in router.routes)  # type: ignore[attr-defined]
    app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics, paths=paths)
    # Every response, whoever sends it, carries x-request-id.
    app.add_middleware(RequestIdMiddleware)
    if settings.allowed_origins:
        # Outermost: preflights are answered before auth (a browser sends no Authorization on OPTIONS), and
        # every other response, errors included, carries the CORS headers a page needs to read it.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=settings.allowed_methods,
            allow_headers=settings.allowed_headers,
            allow_credentials=settings.allow_credentials,
            expose_headers=["x-request-id", "retry-after"],
        )
    return app
