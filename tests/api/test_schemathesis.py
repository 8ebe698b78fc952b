"""Property-based: schemathesis generates requests from our OpenAPI document, valid ones and invalid ones,
and holds every response to that document with all of its checks (issue 13, finding 7): no 5xx, only
declared statuses and content types, responses that match their schemas, invalid data refused, valid data
accepted, authentication enforced.

Valid data: the document states types and ranges. What it cannot state is refused with a 400 whose code
says so (a server setting such as the token cap or the context, or a feature this server does not
support): `SETTING_DEPENDENT` lists those codes, and a schema-valid request refused for any other reason
fails `refused_only_for_a_stated_reason`. The test fuzzes whatever the schema says, so new request fields
are covered as they are added.

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
from hypothesis import strategies as st
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode

from service.api.errors import SCHEMA_UNSTATED
from tests.api.conftest import Server, start_server

API_KEY = "sk-schemathesis-key"
# 400 codes a schema-valid request may get: limits of this server's settings, unsupported features
# and what a JSON Schema cannot state (the model's vocabulary, whether a grammar compiles, rules across fields)
SETTING_DEPENDENT = {
    "unsupported_parameter",
    "max_tokens_exceeded",
    "context_length_exceeded",
    "invalid_draft_head",  # a reload's folder: what the server's disk holds
} | SCHEMA_UNSTATED
CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "400", "401", "404", "429"]}},
        # schemathesis sends the key where the schema asks for it, and leaves it out to test that it must
        "auth": {"openapi": {"HTTPBearer": {"bearer": API_KEY}}},
    }
)


def refused_only_for_a_stated_reason(ctx, response, case) -> None:
    """positive_data_acceptance, narrowed: a schema-valid request refused with 400 names a stated reason."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 400:
        return
    error = response.json()["error"]
    assert error["code"] in SETTING_DEPENDENT, (
        f"a schema-valid request was refused: {error['message']} (code {error['code']!r}); either the "
        "schema should say so or the server should accept it"
    )


# More for a deeper hunt: SCHEMATHESIS_MAX_EXAMPLES=500 pytest tests/api/test_schemathesis.py
MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "25"))
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/v1/drafters"),
    ("GET", "/v1/ocm/top"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("GET", "/tokenizer_info"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("POST", "/v1/admin/reload_drafter"),
]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("schemathesis-server"),
        "--max-tokens-cap", "4", "--default-max-tokens", "4", "--max-queue", "64", "--api-key", API_KEY,
        log_level="warning", api_key=API_KEY,
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(tiny_server: Server):
    return schemathesis.openapi.from_url(f"{tiny_server.url}/openapi.json", config=CONFIG)


def test_every_operation_is_covered(api_schema) -> None:
    documented = {
        (method.upper(), path) for path, item in api_schema.raw_schema["paths"].items() for method in item
    }
    assert documented == set(OPERATIONS)


def test_the_schema_declares_the_statuses_the_server_sends(api_schema, tiny_server: Server) -> None:
    """Issue 13, finding 7: no 422 (the server answers validation errors with 400, OpenAI's way), and the
    statuses the issue saw undeclared are declared: 400 for GET /v1/ocm/top?n=0, 408 and 413 everywhere."""
    paths = api_schema.raw_schema["paths"]
    for path, item in paths.items():
        for method, operation in item.items():
            assert "422" not in operation["responses"], f"{method.upper()} {path}"
            assert {"408", "413"} <= set(operation["responses"]), f"{method.upper()} {path}"
    refused = httpx.get(f"{tiny_server.url}/v1/ocm/top", params={"n": 0}, headers=tiny_server.headers)
    assert refused.status_code == 400
    assert "400" in paths["/v1/ocm/top"]["get"]["responses"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        assert {"400", "404", "429", "503", "504"} <= set(paths[path]["post"]["responses"])


CASES = [(method, path, mode) for method, path in OPERATIONS for mode in ("valid", "invalid")]
CASES = [case for case in CASES if case[2] == "valid" or case[0] == "POST" or case[1].startswith("/v1/")]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_no_request_gets_a_server_error(
    api_schema, tiny_server: Server, method: str, path: str, mode: str
) -> None:
    operation = api_schema[path][method]
    generation_mode = GenerationMode.POSITIVE if mode == "valid" else GenerationMode.NEGATIVE
    model = httpx.get(f"{tiny_server.url}/v1/models", headers=tiny_server.headers).json()["data"][0]["id"]

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
        response = case.call_and_validate(  # every check schemathesis has, and ours
            additional_checks=[refused_only_for_a_stated_reason], timeout=120
        )
        statuses.append(response.status_code)

    run()
    if method == "POST" and mode == "valid" and "{" not in path:  # (a random response id names nothing: 404)
        assert 200 in statuses, f"no generated request reached the engine: {sorted(set(statuses))}"


# ---------------------------------------------------------------- sampling parameters, through HTTP

EDGE_FLOATS = st.sampled_from([0.0, 5e-324, 1e-38, 1e-30, 1e-6, 9.99e-6, 1e-5, 0.5, 1.0, 1.999999, 2.0])


@given(
    temperature=st.one_of(st.none(), EDGE_FLOATS, st.floats(0, 2)),
    top_p=st.one_of(st.none(), EDGE_FLOATS.filter(lambda p: 0 < p <= 1), st.floats(0, 1, exclude_min=True)),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),  # any integer (used modulo 2^64)
    method=st.sampled_from(["vanilla", "sd", "lossy", "csd"]),
    num_speculative_tokens=st.integers(0, 8),
    stream=st.booleans(),
)
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_sampling_parameters_never_get_a_server_error(
    tiny_server: Server, temperature, top_p, seed, method, num_speculative_tokens, stream
) -> None:
    """Every temperature, top_p and seed the API accepts decodes, with every method (issue 13, finding 1's
    fuzzer: a vanishing temperature or top_p once overflowed into a 500)."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "Count: 1, 2, 3,",
        "max_tokens": 4,
        "stream": stream,
        "speculative": {"method": method, "num_speculative_tokens": num_speculative_tokens},
    }
    for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            body[name] = value
    response = httpx.post(
        f"{tiny_server.url}/v1/completions", json=body, headers=tiny_server.headers, timeout=120
    )
    assert response.status_code == 200, response.text
    if stream:
        events = response.text.split("\n\n")
        assert events[-2] == "data: [DONE]" and '"error"' not in response.text, response.text
    else:
        assert response.json()["usage"]["completion_tokens"] >= 1
