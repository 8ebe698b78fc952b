"""Stored responses and `background: true` on `/v1/responses`, through the official `openai` client
(`responses.create(background=True)`, `retrieve`, `cancel`, `delete`) against real servers: the shared one
(greedy, token cap 512) and, for a generation that runs out of time, one with a short request timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from tests.api.conftest import API_KEYS, Server, assert_openai_error, start_server, wait_until

FINISHED = ("completed", "incomplete", "failed", "cancelled")


def poll(client: openai.OpenAI, response_id: str, timeout: float = 120):
    """Retrieve the response until it has finished (as OpenAI's background guide does)."""
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in FINISHED or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_a_background_response_is_queued_then_polled_to_its_end(client: openai.OpenAI, model: str) -> None:
    # lossless speculation: csd's memory learns between requests, so its greedy text may change
    asked = {
        "model": model,
        "input": "Name three colours.",
        "max_output_tokens": 12,
        "extra_body": {"speculative": {"method": "sd"}},
    }
    started = time.monotonic()
    queued = client.responses.create(background=True, **asked)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    assert queued.usage is None
    seen = {queued.status}
    while (response := client.responses.retrieve(queued.id)).status not in FINISHED:
        seen.add(response.status)
        assert response.status in ("queued", "in_progress")
        assert time.monotonic() - started < 120
        time.sleep(0.02)
    assert response.status in ("completed", "incomplete") and response.id == queued.id
    assert response.background is True
    # the same generation as the request answered at once (greedy)
    direct = client.responses.create(**asked)
    assert response.output_text == direct.output_text and response.output_text
    assert response.usage.output_tokens == direct.usage.output_tokens
    assert response.model_extra["speculative"]["target_forwards"] >= 1
    # a finished background response continues a conversation like any stored one
    follow = client.responses.create(
        model=model, input="One more.", previous_response_id=queued.id, max_output_tokens=4
    )
    assert follow.previous_response_id == queued.id
    assert follow.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens


def aborted(server: Server) -> float:
    """Generations the engine gave up (cancelled, timed out or their client gone)."""
    return server.metrics().value("vllm:request_success_total", finished_reason="abort")


def count_in_background(client: openai.OpenAI, model: str):
    """A background response long enough (up to 512 tokens) to be still running when the test acts on it."""
    return client.responses.create(
        model=model, input="Count from one to five hundred.", max_output_tokens=512, background=True
    )


def test_an_unfinished_background_response_cannot_be_continued(
    client: openai.OpenAI, model: str, api_server: Server
) -> None:
    before = aborted(api_server)
    queued = count_in_background(client, model)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=model, input="And then?", previous_response_id=queued.id)
    assert raised.value.body["code"] == "previous_response_not_completed"
    assert raised.value.body["param"] == "previous_response_id"
    if client.responses.cancel(queued.id).status == "cancelled":  # counted before the next test counts
        assert wait_until(lambda: aborted(api_server) == before + 1, timeout=30)


def test_cancel_stops_the_generation(client: openai.OpenAI, model: str, api_server: Server) -> None:
    before = aborted(api_server)
    queued = count_in_background(client, model)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    # the engine dropped it (a generation that ran its 512 tokens would have finished with "length")
    assert wait_until(lambda: aborted(api_server) == before + 1, timeout=30)
    time.sleep(0.5)
    after = client.responses.retrieve(queued.id)
    assert after.status == "cancelled" and after.usage is None
    # cancelling again (or too late) answers the response as it ended, and is no error
    assert client.responses.cancel(queued.id).status == "cancelled"
    finished = poll(
        client, client.responses.create(model=model, input="Hi", max_output_tokens=2, background=True).id
    )
    assert finished.status in ("completed", "incomplete")
    assert client.responses.cancel(finished.id).status == finished.status


def test_retrieve_and_delete_a_stored_response(client: openai.OpenAI, model: str, api_server: Server) -> None:
    created = client.responses.create(model=model, input="Name a fruit.", max_output_tokens=6)
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    # only a background response can be cancelled
    with api_server.client() as http:
        refused = http.post(f"/v1/responses/{created.id}/cancel")
        assert_openai_error(refused, 400, param="response_id", code="response_not_cancellable")
        # the same error for GET with stream: true, which this server cannot replay
        assert_openai_error(
            http.get(f"/v1/responses/{created.id}", params={"stream": "true"}),
            400,
            code="unsupported_parameter",
        )
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.retrieve(created.id)
    assert raised.value.body["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as raised:  # nor does it continue a conversation
        client.responses.create(model=model, input="Hi", previous_response_id=created.id)
    assert raised.value.body["code"] == "previous_response_not_found"
    # store: false keeps nothing to retrieve
    unstored = client.responses.create(model=model, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


def test_delete_cancels_a_running_background_response(
    client: openai.OpenAI, model: str, api_server: Server
) -> None:
    before = aborted(api_server)
    queued = count_in_background(client, model)
    client.responses.delete(queued.id)
    assert wait_until(lambda: aborted(api_server) == before + 1, timeout=30)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)


@pytest.fixture(scope="module")
def hurried_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Every request must finish within 0.2 s: too little for 64 tokens on any CPU this runs on."""
    server = start_server(
        tmp_path_factory.mktemp("hurried-server"), "--request-timeout", "0.2", "--api-key", API_KEYS[0],
        api_key=API_KEYS[0], log_level="warning",
    )  # fmt: skip
    yield server
    server.stop()


def test_a_background_response_that_runs_out_of_time_fails(hurried_server: Server) -> None:
    client = openai.OpenAI(
        base_url=f"{hurried_server.url}/v1", api_key=API_KEYS[0], max_retries=0, timeout=60
    )
    model = client.models.list().data[0].id
    text = "The quick brown fox jumps over the lazy dog. " * 100  # a prefill of ~1000 tokens, then 64 more
    queued = client.responses.create(
        model=model, input=f"{text}\nRepeat the text above.", max_output_tokens=64, background=True
    )
    failed = poll(client, queued.id, timeout=60)
    assert failed.status == "failed", failed
    assert failed.error.code == "timeout" and "timed out" in failed.error.message
    # the answer at once gets the same reason as its status code
    with pytest.raises(openai.APIStatusError) as raised:
        client.responses.create(model=model, input=f"{text}\nRepeat the text above.", max_output_tokens=64)
    assert raised.value.status_code == 504
