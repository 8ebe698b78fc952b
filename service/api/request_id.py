"""`x-request-id` on every HTTP response: the client's own id echoed back, or one made up here.

A pure ASGI middleware (not BaseHTTPMiddleware, which would buffer streaming responses): it rewrites the
`http.response.start` message, so JSON bodies, Server-Sent Events and error responses (401, 404, 413, 429,
5xx, including those sent before routing) all carry it. The id is also put in `scope["state"]` so a
route or log line can quote it.

A client's id is echoed only if it is short printable ASCII (at most `MAX_REQUEST_ID_CHARS`, no control
characters): a header value is copied into logs and other systems' headers, so anything else is replaced
by a fresh id rather than passed on.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import SERVER, APIError, error_response

HEADER = b"x-request-id"
MAX_REQUEST_ID_CHARS = 128


def valid_request_id(raw: bytes) -> str | None:
    """The client's id when it is safe to echo (1..MAX_REQUEST_ID_CHARS printable ASCII), else None."""
    if not 0 < len(raw) <= MAX_REQUEST_ID_CHARS:
        return None
    if any(byte < 0x21 or byte > 0x7E for byte in raw):  # no spaces, controls or non-ASCII bytes
        return None
    return raw.decode("ascii")


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = None
        for name, value in scope.get("headers", ()):
            if name == HEADER:
                request_id = valid_request_id(value)
                break
        if request_id is None:
            request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        encoded = request_id.encode("ascii")

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                headers.append((HEADER, encoded))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # An unexpected error: Starlette's outermost ServerErrorMiddleware would answer the 500 without
            # passing through here, so the id would be missing exactly when it is most wanted. Answer it
            # here (the same body as errors._on_unexpected); that middleware still logs the traceback and,
            # seeing the response started, sends nothing more.
            if not started:
                error = APIError(
                    500, "internal server error; see the server log", type=SERVER, code="internal_error"
                )
                await error_response(error)(scope, receive, send_with_id)
            raise
