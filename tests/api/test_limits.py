"""Behaviour under load: the queue bound (429 + Retry-After), the per-request timeout, graceful shutdown."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Server, assert_openai_error, start_server, wait_until

MODEL = "SmolLM2-135M-Instruct"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
TIMEOUT_S = 6
BODY_TIMEOUT_S = 3
# Vanilla decoding, one token per round: a request this long outlives the timeout on any machine.
LONG = {"model": MODEL, "prompt": COUNTING, "max_tokens": 2000, "speculative": {"method": "vanilla"}}


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One generation runs, one may wait, the rest get 429; each request has TIMEOUT_S seconds, and
    BODY_TIMEOUT_S for its body."""
    server = start_server(
        tmp_path_factory.mktemp("busy-server"),
        "--max-queue", "1", "--max-batch-size", "1", "--request-timeout", str(TIMEOUT_S), "--max-tokens-cap", "2048",
        "--body-timeout", str(BODY_TIMEOUT_S),
    )  # fmt: skip
    yield server
    server.stop()


def test_queue_bound_gives_429_with_retry_after(busy_server: Server) -> None:
    with httpx.Client(base_url=busy_server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep it: a dropped iterator closes the connection
            next(line for line in lines if line.startswith("data: "))  # it runs now
            waiting_result: dict = {}

            def wait_in_queue() -> None:
                with httpx.Client(base_url=busy_server.url, timeout=60) as other:
                    waiting_result["response"] = other.post("/v1/completions", json={**LONG, "max_tokens": 4})

            waiter = threading.Thread(target=wait_in_queue)
            waiter.start()
            assert wait_until(
                lambda: busy_server.metrics().value("vllm:num_requests_waiting") == 1, timeout=10
            )
            refused = http.post("/v1/completions", json={**LONG, "max_tokens": 4})
            error = assert_openai_error(refused, 429, code="queue_full")
            assert error["type"] == "rate_limit_error"
            assert int(refused.headers["retry-after"]) >= 1
            # Refused before any prompt work: a chat request whose templating, tokenizing and JSON-schema
            # compiling would each take a while (and whose prompt is too long for the model anyway) is told
            # to back off at once, on every endpoint, while the engine thread is busy generating.
            heavy = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Summarise this. " + "word " * 20_000}],
                "max_tokens": 4,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "s",
                        "schema": {"type": "object", "properties": {"a": {"type": "string"}}},
                    },
                },
            }
            waits = []
            for path, body in [("/v1/chat/completions", heavy)] * 8 + [
                ("/v1/responses", {"model": MODEL, "input": "hi"})
            ]:
                started = time.monotonic()
                refused = http.post(path, json=body)
                waits.append(time.monotonic() - started)
                assert_openai_error(refused, 429, code="queue_full")
            waits.sort()
            assert waits[len(waits) // 2] < 0.1, (
                waits
            )  # the median: one slow scheduling blip is not a regression
        # Hanging up on the running stream lets the waiting request through.
        waiter.join(60)
    assert waiting_result["response"].status_code == 200, waiting_result["response"].text
    counted = busy_server.metrics().value("csd_requests_total", endpoint="/v1/completions", status_code="429")
    assert counted >= 1


def test_request_timeout_is_504_and_stops_the_work(busy_server: Server) -> None:
    with httpx.Client(base_url=busy_server.url, timeout=60) as http:
        response = http.post("/v1/completions", json=LONG)
    error = assert_openai_error(response, 504, code="timeout")
    assert error["type"] == "timeout_error"
    assert wait_until(lambda: busy_server.metrics().value("vllm:num_requests_running") == 0, timeout=10)


# The same long generation through each API: the one driver ends every stream the same way, in its format.
STREAMED = {"model": MODEL, "speculative": {"method": "vanilla"}, "stream": True}
LONG_STREAMS = {
    "completions": ("/v1/completions", {**LONG, "stream": True}),
    # with the usage so far on every chunk: the error event still carries nothing but the error
    "chat": ("/v1/chat/completions", {
        **STREAMED, "messages": [{"role": "user", "content": COUNTING}], "max_tokens": 2000,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }),
    "responses": ("/v1/responses", {**STREAMED, "input": COUNTING, "max_output_tokens": 2000}),
}  # fmt: skip


@pytest.mark.parametrize("api", LONG_STREAMS)
def test_timeout_after_the_stream_began_is_an_error_event(busy_server: Server, api: str) -> None:
    path, body = LONG_STREAMS[api]
    with httpx.Client(base_url=busy_server.url, timeout=60) as http:
        response = http.post(path, json=body)
    assert response.status_code == 200
    events = response.content.split(b"\n\n")
    assert events[-1] == b""
    if api == "responses":  # OpenAI's typed events: the last is `error`, and no [DONE]
        assert events[0].startswith(b"event: response.created\n")
        kind, data = events[-2].split(b"\n")
        last = json.loads(data.removeprefix(b"data: "))
        assert kind == b"event: error" and last["type"] == "error" and last["code"] == "timeout", last
    else:
        assert events[-2] == b"data: [DONE]"
        last = json.loads(events[-3].removeprefix(b"data: "))
        assert set(last) == {"error"} and last["error"]["code"] == "timeout"
        first = json.loads(events[0].removeprefix(b"data: "))["object"]
        assert first == ("text_completion" if api == "completions" else "chat.completion.chunk")
    # the work stopped with the stream
    assert wait_until(lambda: busy_server.metrics().value("vllm:num_requests_running") == 0, timeout=10)


def raw_request(
    server: Server, head: bytes, trickle: bytes = b"", every_s: float = 0.0
) -> tuple[bytes, float]:
    """Send `head` on a raw socket, then `trickle` one byte every `every_s`; returns everything the server
    sent until it closed the connection, and how long that took. Fails if the server never closes it."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=BODY_TIMEOUT_S * 5) as sock:
        sock.sendall(head)
        for byte in trickle:
            time.sleep(every_s)
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # closed by the server: what we want to see
                break
        received = b""
        while chunk := sock.recv(65536):  # b"": the server closed the connection
            received += chunk
    return received, time.monotonic() - started


def head(content_length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {content_length}\r\n\r\n".encode()
    )


def parse_response(raw: bytes) -> tuple[int, dict]:
    status_line, _, rest = raw.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


@pytest.mark.parametrize(
    "send",
    [
        pytest.param({"head": head(100) + b'{"model": "x"'}, id="content-length-beyond-the-body"),
        pytest.param(
            {"head": head(5000), "trickle": b'{"model": "x", ' * 20, "every_s": 0.5}, id="slowloris"
        ),
    ],
)
def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closed(
    busy_server: Server, send: dict
) -> None:
    """Issue 13, finding 6: a Content-Length larger than the body, or a body sent a byte at a time, holds
    nothing for longer than the body timeout: 408 in OpenAI's shape, then the server closes the socket.
    Meanwhile the server serves others."""
    raw, took = raw_request(busy_server, **send)
    status, body = parse_response(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout", raw
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert b"connection: close" in raw.lower()
    assert BODY_TIMEOUT_S * 0.9 <= took < BODY_TIMEOUT_S * 4  # closed by the server, not by our timeout
    assert httpx.get(f"{busy_server.url}/health", timeout=30).status_code == 200


def test_sigterm_drains_running_requests_then_exits(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--shutdown-grace", "60")
    body = {
        "model": MODEL,
        "prompt": COUNTING,
        "max_tokens": 12,
        "stream": True,
        "speculative": {"method": "vanilla"},
    }
    with (
        httpx.Client(base_url=server.url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]", rest  # the running request finished normally
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    # After draining, uvicorn re-raises the signal it caught, so the process ends "terminated by SIGTERM"
    # as supervisors expect; the lifespan shutdown (store flushed, worker stopped) ran before that.
    assert server.proc.wait(60) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.log()
    with pytest.raises(httpx.TransportError):  # and nobody listens any more
        httpx.get(f"{server.url}/health", timeout=5)
    assert "shutting down" in server.log()


def test_streams_still_running_when_the_grace_ends_get_an_error_event_and_done(tmp_path: Path) -> None:
    """Issue 13, finding 3: a stream that outlives the shutdown grace ends with an OpenAI error event
    (503 shutting_down) and [DONE], a non-streamed request with a 503 body; the log has no traceback."""
    grace = 2
    server = start_server(tmp_path, "--shutdown-grace", str(grace), "--max-tokens-cap", "2048")
    answers: dict[str, httpx.Response] = {}

    def collect() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            answers["json"] = http.post("/v1/completions", json=LONG)

    with (
        httpx.Client(base_url=server.url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the stream runs
        other = threading.Thread(target=collect)
        other.start()
        running = lambda: httpx.get(f"{server.url}/ready", timeout=10).json()["requests"]["running"]  # noqa: E731
        assert wait_until(lambda: running() == 2, 60)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
        other.join(60)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2].removeprefix("data: "))
    assert set(error) == {"error"} and error["error"]["code"] == "shutting_down", error
    assert "grace" in error["error"]["message"]
    assert_openai_error(answers["json"], 503, code="shutting_down")
    assert server.proc.wait(60) in (0, -signal.SIGTERM)
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "Cancel" not in log  # uvicorn's 'Cancel N running task(s)' never had to happen
