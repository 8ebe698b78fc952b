"""RequestIdMiddleware on its own, around a small real Starlette app: the cases a live server cannot be
made to show on demand (an unexpected exception before the response starts)."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.testclient import TestClient

from service.api.errors import install_error_handlers
from service.api.request_id import MAX_REQUEST_ID_CHARS, RequestIdMiddleware, valid_request_id


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/id")
    async def show() -> dict:
        return {}

    app.add_middleware(RequestIdMiddleware)
    return app


def test_an_unexpected_500_still_carries_the_id() -> None:
    with TestClient(_app(), raise_server_exceptions=False) as client:
        response = client.get("/boom", headers={"x-request-id": "trace-500"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "trace-500"
    assert response.json()["error"]["code"] == "internal_error"
    assert "a bug" not in response.text


def test_the_id_is_never_doubled() -> None:
    with TestClient(_app()) as client:
        response = client.get("/id", headers={"x-request-id": "once"})
    assert response.headers.get_list("x-request-id") == ["once"]


def test_which_client_ids_are_echoed() -> None:
    assert valid_request_id(b"abc-123_X.y:z/=") == "abc-123_X.y:z/="
    assert valid_request_id(b"a" * MAX_REQUEST_ID_CHARS) is not None
    for bad in (b"", b"a" * (MAX_REQUEST_ID_CHARS + 1), b"a b", b"a\x00", b"\xc3\xa9", b"a\r\nSet-Cookie: x"):
        assert valid_request_id(bad) is None, bad
