"""Every bad input gets the right status and OpenAI's error shape, never a 422, a 500 or a traceback."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import Server, assert_openai_error

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hi"}]
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}

# (case id, path, body, status, param, code)
BAD_BODIES = [
    ("missing-model", "/v1/completions", {"prompt": "Hi"}, 400, "model", "invalid_value"),
    ("missing-prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", "invalid_value"),
    ("temperature-not-a-number", "/v1/completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("max-tokens-as-string", "/v1/completions", {**COMPLETION, "max_tokens": "10"}, 400, "max_tokens", "invalid_value"),
    ("max-tokens-float", "/v1/completions", {**COMPLETION, "max_tokens": 2.5}, 400, "max_tokens", "invalid_value"),
    ("stream-as-string", "/v1/completions", {**COMPLETION, "stream": "yes"}, 400, "stream", "invalid_value"),
    ("prompt-number", "/v1/completions", {**COMPLETION, "prompt": 5}, 400, "prompt", "invalid_value"),
    ("messages-string", "/v1/chat/completions", {"model": MODEL, "messages": "Hi"}, 400, "messages", "invalid_value"),
    ("messages-empty", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    ("unknown-role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "invalid_value"),
    ("image-part", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content", "invalid_value"),
    ("temperature-too-high", "/v1/completions", {**COMPLETION, "temperature": 3}, 400, "temperature", "invalid_value"),
    ("temperature-negative", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": -0.1}, 400, "temperature", "invalid_value"),
    ("top-p-zero", "/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("max-tokens-zero", "/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", "inconsistent_parameters"),
    ("max-tokens-above-cap", "/v1/completions", {**COMPLETION, "max_tokens": 513}, 400, "max_tokens", "max_tokens_exceeded"),
    ("max-completion-tokens-above-cap", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_completion_tokens": 100000}, 400, "max_completion_tokens", "max_tokens_exceeded"),
    ("unknown-model", "/v1/completions", {**COMPLETION, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("n-above-batch", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 99}, 400, "n", "invalid_value"),
    ("top-logprobs-too-many", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    ("logprobs-completion-too-many", "/v1/completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("legacy-functions", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    ("response-format-unknown", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type", "invalid_value"),
    ("echo-not-a-bool", "/v1/completions", {**COMPLETION, "echo": "yes"}, 400, "echo", "invalid_value"),
    ("best-of", "/v1/completions", {**COMPLETION, "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("presence-penalty-out-of-range", "/v1/completions", {**COMPLETION, "presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    ("token-id-out-of-vocabulary", "/v1/completions", {**COMPLETION, "prompt": [1, 2, 99999999]}, 400, "prompt", "invalid_token_id"),
    ("prompt-batch-streamed", "/v1/completions", {**COMPLETION, "prompt": ["a", "b"], "stream": True}, 400, "prompt", "unsupported_parameter"),
    ("empty-prompt", "/v1/completions", {**COMPLETION, "prompt": ""}, 400, "prompt", "invalid_value"),
    ("stream-options-without-stream", "/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options", "unsupported_parameter"),
    ("too-many-stops", "/v1/completions", {**COMPLETION, "stop": ["x"] * 17}, 400, "stop", "invalid_value"),
    ("empty-stop", "/v1/completions", {**COMPLETION, "stop": [""]}, 400, "stop", "invalid_value"),
    ("speculative-typo", "/v1/completions", {**COMPLETION, "speculative": {"methd": "sd"}}, 400, "speculative.methd", "invalid_value"),
    ("speculative-bad-method", "/v1/completions", {**COMPLETION, "speculative": {"method": "magic"}}, 400, "speculative.method", "invalid_value"),
    ("speculative-tau-zero", "/v1/completions", {**COMPLETION, "speculative": {"tau": 0}}, 400, "speculative.tau", "invalid_value"),
    ("speculative-k-too-big", "/v1/completions", {**COMPLETION, "speculative": {"num_speculative_tokens": 65}}, 400, "speculative.num_speculative_tokens", "invalid_value"),
    ("speculative-missing-drafter", "/v1/completions", {**COMPLETION, "speculative": {"drafter": "model"}}, 400, "speculative.drafter", "unsupported_parameter"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_request_bodies(
    api_server: Server, path: str, body: dict, status: int, param: str | None, code: str
) -> None:
    with api_server.client() as http:
        assert_openai_error(http.post(path, json=body), status, param=param, code=code)


def test_malformed_json(api_server: Server) -> None:
    with api_server.client() as http:
        response = http.post(
            "/v1/chat/completions",
            content=b'{"model": "x", "messages": [',
            headers={"Content-Type": "application/json"},
        )
    error = assert_openai_error(response, 400, code="invalid_json")
    assert "not valid JSON" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_invalid_utf8_and_too_deep_json_get_a_code(api_server: Server, path: str) -> None:
    """Bodies no JSON parser takes: bytes that are not UTF-8 (a Latin-1 "é"), and JSON nested 10,000 deep
    (Python's parser gives up on recursion). Both are the client's fault: 400, with a code to branch on."""
    latin1 = '{"model": "x", "messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1")
    deep = b"[" * 10_000 + b"]" * 10_000
    with api_server.client() as http:
        for body, code in ((latin1, "invalid_utf8"), (deep, "json_too_deep")):
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
            error = assert_openai_error(response, 400, param=None, code=code)
            assert "parsing the body" not in error["message"]  # FastAPI's words: say what was wrong
        error = assert_openai_error(
            http.post(path, content=latin1, headers={"Content-Type": "application/json"}), 400
        )
        assert "UTF-8" in error["message"] and "0xe9" in error["message"]


def test_body_must_be_a_json_object(api_server: Server) -> None:
    with api_server.client() as http:
        for kwargs in (
            {"json": [COMPLETION]},
            {"content": b'{"model": "x", "prompt": "y"}', "headers": {"Content-Type": "text/plain"}},
        ):
            error = assert_openai_error(http.post("/v1/completions", **kwargs), 400, param=None)
            assert "must be a JSON object" in error["message"]


def test_prompt_longer_than_the_context(api_server: Server) -> None:
    with api_server.client() as http:
        response = http.post("/v1/completions", json={**COMPLETION, "prompt": "hello " * 9000})
    error = assert_openai_error(response, 400, param="prompt", code="context_length_exceeded")
    assert "8192" in error["message"]


def test_prompt_plus_max_tokens_beyond_the_context(api_server: Server) -> None:
    prompt = "hello " * 8170  # a little under the 8192-token context
    with api_server.client() as http:
        response = http.post("/v1/completions", json={**COMPLETION, "prompt": prompt, "max_tokens": 64})
    assert_openai_error(response, 400, param="max_tokens", code="context_length_exceeded")


def test_oversize_body_is_413(api_server: Server) -> None:
    big = {**COMPLETION, "prompt": "x" * 1_100_000}  # over the default 1 MB limit
    with api_server.client() as http:
        assert_openai_error(http.post("/v1/completions", json=big), 413, code="request_too_large")

        def chunks():  # no Content-Length: the limit must hold for a streamed body too
            yield b'{"model": "x", "prompt": "'
            for _ in range(120):
                yield b"y" * 10_000
            yield b'"}'

        response = http.post(
            "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
        )
    assert_openai_error(response, 413, code="request_too_large")


def test_unknown_route_and_wrong_method(api_server: Server) -> None:
    with api_server.client() as http:
        assert_openai_error(http.get("/v1/engines"), 404, code="route_not_found")
        wrong = http.get("/v1/completions")
        assert_openai_error(wrong, 405, code="method_not_allowed")
        assert wrong.headers["allow"] == "POST"
        assert_openai_error(http.get(f"/v1/models/{MODEL}-nope"), 404, param="model", code="model_not_found")
        assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_unknown_fields_are_ignored(api_server: Server) -> None:
    """Newer clients send fields we have never heard of (store, metadata, ...): like vLLM, ignore them."""
    body = {**COMPLETION, "store": False, "metadata": {"a": "b"}, "service_tier": "auto", "user": "u-1"}
    with api_server.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def test_errors_are_counted_by_status(api_server: Server) -> None:
    before = api_server.metrics()
    with httpx.Client(base_url=api_server.url, timeout=60) as http:
        http.get("/no/such/route")
        http.post("/v1/completions", content=b"x" * 1_000_001, headers=api_server.headers)
    after = api_server.metrics()
    for endpoint, status in (("unmatched", "404"), ("/v1/completions", "413")):
        key = {"endpoint": endpoint, "status_code": status}
        assert after.value("csd_requests_total", **key) - before.value("csd_requests_total", **key) == 1, key


def test_chat_max_completion_tokens_beyond_the_context_names_that_field(api_server: Server) -> None:
    messages = [{"role": "user", "content": "hello " * 8150}]
    with api_server.client() as http:
        response = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_completion_tokens": 64}
        )
    error = assert_openai_error(response, 400, param="max_completion_tokens", code="context_length_exceeded")
    assert "max_completion_tokens asks for 64" in error["message"]


def test_error_messages_name_the_real_problem(api_server: Server) -> None:
    """Texts that misled (issue 13, finding 8): an empty body said 'None is required', n=0 said 'n > 1 is not
    supported', 100 stop strings said 'Input should be a valid string'."""
    with api_server.client() as http:
        empty = http.post("/v1/completions", content=b"", headers={"Content-Type": "application/json"})
        error = assert_openai_error(empty, 400, param=None)
        assert "request body is required" in error["message"] and "None" not in error["message"]
        error = assert_openai_error(http.post("/v1/completions", json={**COMPLETION, "n": 0}), 400, param="n")
        assert "greater than or equal to 1" in error["message"] and "n > 1" not in error["message"]
        many = http.post("/v1/completions", json={**COMPLETION, "stop": ["x"] * 100})
        error = assert_openai_error(many, 400, param="stop", code="invalid_value")
        assert "at most 16 stop sequences, got 100" in error["message"], error


def test_a_key_sent_in_the_query_string_never_reaches_the_log(api_server: Server) -> None:
    """Keys travel in the Authorization header; one sent as ?api_key= is refused, and the access log writes
    the request line with the value redacted (issue 13, finding 5)."""
    secret = "sk-query-string-secret-4711"
    for query in (f"api_key={secret}", f"x=1&token={secret}", f"Access-Token={secret}"):
        response = httpx.get(f"{api_server.url}/v1/models?{query}", timeout=30)
        assert_openai_error(response, 401)
    log = api_server.log()
    assert "/v1/models?api_key=[redacted]" in log and "/v1/models?x=1&token=[redacted]" in log
    assert secret not in log
