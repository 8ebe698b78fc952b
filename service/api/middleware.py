"""Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streaming responses).

- `RequestMetricsMiddleware` counts every HTTP response by route and status code, including the ones that
  never reach a route (401, 404, 413, 429, 5xx), except probes and scrapes (`/health`, `/ready`,
  `/metrics`), as vLLM does: they would be half of a quiet server's responses, and /ready's 503s while the
  model loads would show as server errors.
- `BodyLimitMiddleware` refuses request bodies over the limit with 413 before any parsing: at once when
  Content-Length says so, or as soon as a chunked body grows past it. A body that does not arrive in full
  within `body_timeout_s` (a Content-Length larger than what is sent, a slowloris trickle) gets 408 and
  the connection is closed: otherwise it would hold a connection, and a task, forever.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import CLIENT_CLOSED_REQUEST, APIError, error_response
from service.api.metrics import ServiceMetrics

# Kubelet probes and Prometheus scrapes: not traffic.
UNCOUNTED_PATHS = frozenset({"/health", "/ready", "/metrics"})


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths  # the app's route paths, for responses sent before routing (413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except BaseException:
            if status is None:
                status = 500
            raise
        finally:
            # The route's template, never a raw unknown path: those must not grow the label set.
            endpoint = getattr(scope.get("route"), "path", None)
            if endpoint is None:
                endpoint = scope["path"] if scope["path"] in self.paths else "unmatched"
            code = status if status is not None else CLIENT_CLOSED_REQUEST
            self.metrics.requests.labels(self.metrics.model_name, endpoint, str(code)).inc()


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    def _too_slow(self, received: int) -> APIError:
        return APIError(
            408,
            f"the request body did not arrive within {self.body_timeout_s:g}s ({received} bytes received); "
            "send the whole body at once, with a Content-Length that matches it",
            code="request_timeout",
            headers={"Connection": "close"},  # uvicorn closes the connection after this response
        )

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_body_bytes} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_body_bytes:
                    await error_response(self._too_large())(scope, receive, send)
                    return
        # Read the body here (it is small: at most the limit) and replay it; later receive() calls go to
        # the server, so the app still hears about a client that disconnects.
        chunks: list[bytes] = []
        size = 0
        more = True
        deadline = time.monotonic() + self.body_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                await error_response(self._too_slow(size))(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client left before sending its body
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await error_response(self._too_large())(scope, receive, send)
                return
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
