"""Property-based: schemathesis generates requests from our OpenAPI document, valid ones and invalid ones;
none may get a 5xx.

Bounded to keep the suite fast: a server whose token cap is 4 (every generation is short), and a fixed
number of examples per operation and mode. (schemathesis' lazy `from_fixture` mode does not run on
pytest 9, so each operation is its own parametrized test driving a Hypothesis strategy.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode

from tests.api.conftest import Server, start_server

# More for a deeper hunt: SCHEMATHESIS_MAX_EXAMPLES=500 pytest tests/api/test_schemathesis.py
MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "25"))
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/v1/ocm/top"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("GET", "/tokenizer_info"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("schemathesis-server"),
        "--max-tokens-cap", "4", "--default-max-tokens", "4", "--max-queue", "64",
        log_level="warning",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(tiny_server: Server):
    return schemathesis.openapi.from_url(f"{tiny_server.url}/openapi.json")


def test_every_operation_is_covered(api_schema) -> None:
    documented = {
        (method.upper(), path) for path, item in api_schema.raw_schema["paths"].items() for method in item
    }
    assert documented == set(OPERATIONS)


CASES = [(method, path, mode) for method, path in OPERATIONS for mode in ("valid", "invalid")]
CASES = [case for case in CASES if case[2] == "valid" or case[0] == "POST" or case[1].startswith("/v1/")]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_no_request_gets_a_server_error(
    api_schema, tiny_server: Server, method: str, path: str, mode: str
) -> None:
    operation = api_schema[path][method]
    generation_mode = GenerationMode.POSITIVE if mode == "valid" else GenerationMode.NEGATIVE
    model = httpx.get(f"{tiny_server.url}/v1/models").json()["data"][0]["id"]

    def served_model(case):
        # A random model name is a 404 before anything interesting happens: name the served one.
        if mode == "valid" and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        return case

    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=generation_mode).map(served_model))
    @settings(
        max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    def run(case) -> None:
        response = case.call_and_validate(checks=[not_a_server_error], timeout=120)
        statuses.append(response.status_code)

    run()
    if method == "POST" and mode == "valid":
        assert 200 in statuses, f"no generated request reached the engine: {sorted(set(statuses))}"
