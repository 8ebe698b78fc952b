"""CORS against a real `csd serve --allowed-origins ...`: preflights over HTTP, and a page served from
another origin (a second local port) that calls the API with fetch in a real headless Chromium.

The server allows one origin (the page's first port); the same page served from a second port is another
origin, which the browser must refuse to let read the answer.
"""

from __future__ import annotations

import functools
import http.server
import json
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Server, start_server
from tests.playground.test_playground import CHROMIUM_ARGS, chromium_path  # noqa: F401 (a fixture)

API_KEY = "sk-cors-test-key"
PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>another origin</title></head>
<body><p>a page on another origin</p></body></html>"""
# What the page runs: a chat completion through fetch, as a browser app would (a preflighted POST: JSON
# body and an Authorization header).
FETCH = """async ([url, key]) => {
  try {
    const r = await fetch(url + "/v1/chat/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key},
      body: JSON.stringify({model: "embedded", max_tokens: 4,
                            messages: [{role: "user", content: "Say hi"}]}),
    });
    return {ok: true, status: r.status, body: await r.json(), requestId: r.headers.get("x-request-id")};
  } catch (e) {
    return {ok: false, error: String(e)};
  }
}"""


class _PageServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def _serve_page(folder: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    httpd = _PageServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def page_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cors-page")
    (folder / "index.html").write_text(PAGE)
    return folder


@pytest.fixture(scope="module")
def allowed_origin(page_folder: Path) -> Iterator[str]:
    yield from _serve_page(page_folder)


@pytest.fixture(scope="module")
def other_origin(page_folder: Path) -> Iterator[str]:
    yield from _serve_page(page_folder)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, allowed_origin: str) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("cors-server"),
        "--api-key", API_KEY, "--max-tokens-cap", "16",
        "--allowed-origins", json.dumps([allowed_origin]),
        "--allowed-methods", '["GET", "POST"]',
        api_key=API_KEY,
    )  # fmt: skip
    yield server
    server.stop()


def _preflight(server: Server, origin: str) -> httpx.Response:
    return httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=30,
    )


def test_preflight_from_an_allowed_origin_gets_the_cors_headers(server: Server, allowed_origin: str) -> None:
    response = _preflight(server, allowed_origin)
    assert response.status_code == 200, response.text  # answered before auth: a preflight carries no key
    assert response.headers["access-control-allow-origin"] == allowed_origin
    methods = response.headers["access-control-allow-methods"].replace(" ", "").split(",")
    assert set(methods) == {"GET", "POST"}
    allowed_headers = response.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers and "content-type" in allowed_headers
    assert "access-control-allow-credentials" not in response.headers  # off unless --allow-credentials


def test_preflight_from_another_origin_gets_none(server: Server, other_origin: str) -> None:
    response = _preflight(server, other_origin)
    assert response.status_code == 400
    assert "access-control-allow-origin" not in response.headers


def test_a_disallowed_method_is_refused_at_preflight(server: Server, allowed_origin: str) -> None:
    response = httpx.options(
        f"{server.url}/v1/models",
        headers={"Origin": allowed_origin, "Access-Control-Request-Method": "DELETE"},
        timeout=30,
    )
    assert response.status_code == 400
    assert "DELETE" not in response.headers.get("access-control-allow-methods", "")


def test_errors_carry_the_cors_headers_too(server: Server, allowed_origin: str) -> None:
    # A page must be able to read a 401's message, not only a success.
    response = httpx.get(f"{server.url}/v1/models", headers={"Origin": allowed_origin}, timeout=30)
    assert response.status_code == 401
    assert response.headers["access-control-allow-origin"] == allowed_origin
    assert "x-request-id" in response.headers["access-control-expose-headers"]


@pytest.fixture(scope="module")
def browser(chromium_path: str):  # noqa: F811
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def _fetch_from(browser, page_url: str, server: Server) -> tuple[dict, list[str]]:
    context = browser.new_context()
    try:
        page = context.new_page()
        console: list[str] = []
        page.on("console", lambda m: console.append(m.text))
        page.goto(page_url + "/index.html")
        assert page.evaluate("location.origin") == page_url  # the page really is on the other origin
        return page.evaluate(FETCH, [server.url, API_KEY]), console
    finally:
        context.close()


def test_a_page_on_an_allowed_origin_calls_the_api(browser, server: Server, allowed_origin: str) -> None:
    assert allowed_origin != server.url
    result, _ = _fetch_from(browser, allowed_origin, server)
    assert result["ok"], result
    assert result["status"] == 200
    assert result["body"]["object"] == "chat.completion"
    assert result["body"]["choices"][0]["message"]["role"] == "assistant"
    assert result["body"]["usage"]["completion_tokens"] >= 1
    assert result["requestId"]  # exposed to the page


def test_a_page_on_another_origin_is_refused_by_the_browser(
    browser, server: Server, other_origin: str
) -> None:
    result, console = _fetch_from(browser, other_origin, server)
    assert not result["ok"], result
    assert "Failed to fetch" in result["error"]
    assert any("CORS" in line for line in console), console
