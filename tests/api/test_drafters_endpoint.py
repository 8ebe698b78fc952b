"""GET /v1/drafters: the drafter registry as a real server offers it (docs/api.md). The registry is the one list
of drafters; this endpoint is how a client (the playground) learns it, so its list must be the registry's and
its `available`, `default` and `hint` must be what a request meets."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from service.decoding.drafter_registry import DRAFTERS
from tests.api.conftest import Server, assert_openai_error, start_server

PROMPT = "Repeat: red apple, green pear, red apple, green"


def _drafters(server: Server) -> list[dict]:
    response = httpx.get(f"{server.url}/v1/drafters", headers=server.headers, timeout=30)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    return body["data"]


def _drafter_used(server: Server, drafter: str | None) -> httpx.Response:
    """A two-token completion with strict speculation and `drafter` (None: the server's default)."""
    with server.client() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        speculative = {"method": "sd"} | ({"drafter": drafter} if drafter else {})
        body = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 2,
            "temperature": 0,
            "speculative": speculative,
        }
        return client.post("/v1/completions", json=body)


def test_the_list_is_the_registry_with_what_this_server_offers(api_server: Server):
    listed = _drafters(api_server)
    assert [(d["id"], d["description"]) for d in listed] == [(e.name, e.description) for e in DRAFTERS]
    assert all(d["object"] == "drafter" for d in listed)
    by_id = {d["id"]: d for d in listed}
    # the embedded model ships a head; no --draft-model was given
    assert {name for name, d in by_id.items() if d["available"]} == {
        "ngram",
        "suffix",
        "head",
        "combined",
        "combined-suffix",
    }
    assert by_id["model"]["hint"].startswith("start the server with --draft-model")
    assert all(d["hint"] is None for d in listed if d["available"])
    # `default` is what a request that names no drafter gets
    (default,) = [d["id"] for d in listed if d["default"]]
    response = _drafter_used(api_server, None)
    assert response.status_code == 200, response.text
    assert response.json()["speculative"]["drafter"] == default
    # an unavailable one is refused with the very hint the list gives
    error = assert_openai_error(_drafter_used(api_server, "model"), 400, param="speculative.drafter")
    assert by_id["model"]["hint"] in error["message"]


def test_the_list_needs_a_key(api_server: Server):
    assert_openai_error(httpx.get(f"{api_server.url}/v1/drafters", timeout=30), 401)


@pytest.fixture(scope="module")
def headless_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server without a draft head (--draft-head ''): only prompt lookup can draft."""
    server = start_server(tmp_path_factory.mktemp("no-head"), "--draft-head", "", "--drafter", "ngram")
    yield server
    server.stop()


def test_availability_follows_what_the_server_loaded(headless_server: Server):
    listed = _drafters(headless_server)
    assert [d["id"] for d in listed] == [e.name for e in DRAFTERS]
    by_id = {d["id"]: d for d in listed}
    assert {name for name, d in by_id.items() if d["available"]} == {"ngram", "suffix"}  # they need nothing
    assert [name for name, d in by_id.items() if d["default"]] == ["ngram"]
    for name in ("head", "combined"):
        error = assert_openai_error(_drafter_used(headless_server, name), 400, param="speculative.drafter")
        assert by_id[name]["hint"] and by_id[name]["hint"] in error["message"]
