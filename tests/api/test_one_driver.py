"""One response driver for every API (`service/api/driver.py`): chat completions, completions and the
Responses API, streamed or answered whole, run the same generation the same way, and only their formats
differ. Against the shared real server, with plain httpx:

- the same greedy generation reports the same text, finish and usage (prompt, completion and cached tokens)
  on all six (API, streamed or not) pairs, and as a background response;
- a client that goes away stops the generation on all six: the engine is idle again within a round or so
  and counts an abort.

A deadline that passes mid-stream ends every API's stream with its error event
(`tests/api/test_limits.py::test_timeout_after_the_stream_began_is_an_error_event`).
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tests.api.conftest import Server, wait_until

MODEL = "SmolLM2-135M-Instruct"
VANILLA = {"method": "vanilla", "drafter": "none"}  # the metric labels of a request without speculation
APIS = ("chat", "completions", "responses")
MODES = pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])


def request(api: str, messages: list[dict], prompt_ids: list[int], max_tokens: int, stream: bool) -> tuple:
    """(path, body) of one greedy, unspeculated request: the same prompt through each API (completions
    gets the chat template's token ids, as /tokenize renders them)."""
    common = {"model": MODEL, "temperature": 0, "speculative": {"method": "vanilla"}, "stream": stream}
    if api == "responses":
        return "/v1/responses", {**common, "input": messages, "max_output_tokens": max_tokens}
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    if api == "chat":
        return "/v1/chat/completions", {**common, **usage, "messages": messages, "max_tokens": max_tokens}
    return "/v1/completions", {**common, **usage, "prompt": prompt_ids, "max_tokens": max_tokens}


def payloads(raw: bytes) -> list[dict]:
    """An SSE body's `data:` payloads as JSON (chat and completions end with `[DONE]`, left out)."""
    out = []
    for event in raw.decode().split("\n\n"):
        for line in event.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line.removeprefix("data: ")))
    return out


def outcome(api: str, stream: bool, raw: bytes) -> dict:
    """What a request produced, in one shape whatever its API: text, finish, usage."""
    if api == "responses":
        body = payloads(raw)[-1]["response"] if stream else json.loads(raw)
        assert body["status"] in ("completed", "incomplete"), body
        usage = body["usage"]
        return {
            "text": "".join(part["text"] for item in body["output"] for part in item["content"]),
            "finish": "length" if body["status"] == "incomplete" else "stop",
            "usage": (
                usage["input_tokens"],
                usage["output_tokens"],
                usage["input_tokens_details"]["cached_tokens"],
            ),
        }
    if stream:
        chunks = payloads(raw)
        *deltas, last = chunks
        assert last["choices"] == [] and last["usage"] is not None, last
        choices = [c for chunk in deltas for c in chunk["choices"]]
        text = "".join((c["delta"].get("content") or "") if api == "chat" else c["text"] for c in choices)
        finish = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
        assert len(finish) == 1, finish
        body = {"choices": [{"finish_reason": finish[0]}], "usage": last["usage"]}
    else:
        body = json.loads(raw)
        choice = body["choices"][0]
        text = choice["message"]["content"] if api == "chat" else choice["text"]
    usage = body["usage"]
    return {
        "text": text,
        "finish": body["choices"][0]["finish_reason"],
        "usage": (
            usage["prompt_tokens"],
            usage["completion_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
        ),
    }


def background(http: httpx.Client, messages: list[dict]) -> bytes:
    """A background response of the same request, polled until it has finished: its stored response."""
    path, body = request("responses", messages, [], 8, stream=False)
    queued = http.post(path, json={**body, "background": True})
    assert queued.status_code == 200 and queued.json()["status"] == "queued", queued.text
    deadline = time.monotonic() + 60
    while (stored := http.get(f"{path}/{queued.json()['id']}")).json()["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline, stored.text
        time.sleep(0.05)
    return stored.content


def test_every_api_and_mode_reports_the_same_generation_and_usage(api_server: Server) -> None:
    # a system prompt no other test sent, longer than two prefix-cache blocks: the first request fills the
    # cache, every later one is served the same blocks from it
    tag = uuid.uuid4().hex[:8]
    system = (
        f"Note {tag}. You answer questions about a small lending library in a few words. It opens at nine "
        "and closes at five on weekdays, lends up to six books for three weeks, and charges no fines."
    )
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "How many books can I take?"},
    ]
    with api_server.client() as http:
        tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages})
        assert tokenized.status_code == 200, tokenized.text
        prompt_ids = tokenized.json()["tokens"]
        path, body = request("chat", messages, prompt_ids, 8, stream=False)
        assert http.post(path, json=body).status_code == 200  # warms the prefix cache
        seen = {}
        for api in APIS:
            for stream in (False, True):
                path, body = request(api, messages, prompt_ids, 8, stream)
                response = http.post(path, json=body)
                assert response.status_code == 200, (api, stream, response.text)
                seen[api, stream] = outcome(api, stream, response.content)
        seen["responses", "background"] = outcome("responses", False, background(http, messages))
    first = seen["chat", False]
    assert first["usage"][0] == len(prompt_ids) and first["usage"][1] >= 1 and first["text"]
    assert first["usage"][2] >= 32, "the warmed prompt's full blocks come from the prefix cache"
    for key, got in seen.items():
        assert got == first, (key, got, first)


@pytest.mark.parametrize("api", APIS)
@MODES
def test_a_client_that_goes_away_stops_the_generation(api_server: Server, api: str, stream: bool) -> None:
    before = api_server.metrics().value("vllm:generation_tokens_total", **VANILLA)
    abort = {**VANILLA, "finished_reason": "abort"}
    aborted = api_server.metrics().value("vllm:request_success_total", **abort)
    messages = [{"role": "user", "content": "Count from one to one hundred, in digits, separated by commas."}]
    path, body = request(api, messages, [], 512, stream)
    if api == "completions":
        body["prompt"] = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # the model keeps counting
    if stream:
        with api_server.client() as http, http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # the first round ran (nothing is sent before it): now hang up
    else:
        with api_server.client(timeout=httpx.Timeout(60, read=0.5)) as http, pytest.raises(httpx.ReadTimeout):
            http.post(path, json=body)
    # Stopped within a round or so: the engine is idle again, long before the 512 tokens asked for.
    assert wait_until(lambda: api_server.metrics().value("vllm:num_requests_running") == 0, timeout=20)
    generated = api_server.metrics().value("vllm:generation_tokens_total", **VANILLA) - before
    time.sleep(1.0)
    assert api_server.metrics().value("vllm:generation_tokens_total", **VANILLA) - before == generated
    assert generated < 512
    assert wait_until(lambda: api_server.metrics().value("vllm:request_success_total", **abort) > aborted, 10)
    if stream:
        assert generated <= 8, "the stream was dropped after its first round"
