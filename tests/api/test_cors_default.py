"""CORS is off by default: the shared server (no --allowed-origins) sends no CORS headers, and a preflight
is no preflight to it (an OPTIONS on a POST route: 405). tests/playground/test_cors.py covers it on."""

from __future__ import annotations

import httpx

from tests.api.conftest import Server


def test_no_cors_headers_by_default(api_server: Server) -> None:
    origin = "https://app.example"
    preflight = httpx.options(
        f"{api_server.url}/v1/chat/completions",
        headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        timeout=30,
    )
    assert preflight.status_code == 405
    simple = httpx.get(f"{api_server.url}/health", headers={"Origin": origin}, timeout=30)
    assert simple.status_code == 200
    for response in (preflight, simple):
        assert not any(name.startswith("access-control-") for name in response.headers), response.headers
