"""Engine failures, which no valid request can cause: injected into the real model by a named fake.

The app runs in a real uvicorn server (in a thread of this process, so the test can switch the fault on
and off) on the real embedded model; only the model's forward is wrapped by `FaultInjectingModel`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch
import uvicorn

from ocm_store.base import Namespace
from ocm_store.memory import InMemoryStore
from service.api import create_app
from service.api.server import bind_socket
from service.config import Settings
from service.decoding import Engine, LoadedModel, NgramDrafter, vocabulary_hash
from service.decoding.text import encode_prompt
from service.runtime import Runtime
from tests.api.conftest import assert_openai_error, wait_until

MODEL = "SmolLM2-135M-Instruct"


class InjectedFault(RuntimeError):
    pass


class FaultInjectingModel:
    """FAKE: the real model, except that its forward raises while `fault(input_ids, cache)` says so."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self.fault: Callable[[torch.Tensor, object], bool] | None = None

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __call__(self, *, input_ids: torch.Tensor, cache=None, **kwargs):
        if self.fault is not None and self.fault(input_ids, cache):
            raise InjectedFault("injected fault: the model's forward failed")
        return self._model(input_ids=input_ids, cache=cache, **kwargs)


@dataclass
class InProcessServer:
    url: str
    model: FaultInjectingModel
    target: LoadedModel


@pytest.fixture(scope="module")
def faulty(embedded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess servers: two threads crawl on a shared 2-core machine
    model = FaultInjectingModel(embedded.model)
    target = LoadedModel(
        name=embedded.name, model=model, tokenizer=embedded.tokenizer, revision=embedded.revision
    )  # type: ignore[arg-type]
    settings = Settings(
        ready_probe_interval_s=0.2, ready_probe_timeout_s=20, max_tokens_cap=64, drafter="ngram"
    )
    store = InMemoryStore(path=tmp_path_factory.mktemp("faults") / "ocm.sqlite")
    drafter = NgramDrafter()
    namespaces = {
        "ngram": Namespace(f"{target.name}@{target.revision}", "ngram", vocabulary_hash(target.tokenizer))
    }
    engine = Engine(target, {"ngram": drafter}, {"ngram": store.memory(namespaces["ngram"])})
    runtime = Runtime(settings, target, engine, store, namespaces)
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(create_app(settings, runtime), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        assert wait_until(lambda: _status(url, "/ready") == 200, timeout=120)
        yield InProcessServer(url, model, target)
    finally:
        server.should_exit = True
        thread.join(30)
        torch.set_num_threads(threads)


def _status(url: str, path: str) -> int:
    try:
        return httpx.get(url + path, timeout=10).status_code
    except httpx.TransportError:
        return 0


def always(input_ids: torch.Tensor, cache: object) -> bool:
    return True


def test_engine_failure_is_500_and_the_server_keeps_serving(faulty: InProcessServer) -> None:
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}
    with httpx.Client(base_url=faulty.url, timeout=60) as http:
        faulty.model.fault = always
        try:
            failed = http.post("/v1/completions", json=body)
        finally:
            faulty.model.fault = None
        error = assert_openai_error(failed, 500, code="engine_error")
        assert error["type"] == "server_error"
        assert "injected" not in error["message"]  # internals stay in the server log
        assert http.post("/v1/completions", json=body).status_code == 200


def test_engine_failure_mid_stream_is_a_last_error_event(faulty: InProcessServer) -> None:
    body = {
        "model": MODEL,
        "prompt": "Hello there",
        "max_tokens": 12,
        "stream": True,
        "speculative": {"method": "vanilla"},
    }
    # Fail from the fourth decoding round on (the prefill caches all prompt tokens but the last, and each
    # vanilla round one more): the stream has begun by then.
    cached_at_round_4 = len(encode_prompt(faulty.target.tokenizer, body["prompt"])) - 1 + 3
    faulty.model.fault = lambda ids, cache: cache is not None and cache.get_seq_length() >= cached_at_round_4
    try:
        with httpx.Client(base_url=faulty.url, timeout=60) as http:
            response = http.post("/v1/completions", json=body)
    finally:
        faulty.model.fault = None
    assert response.status_code == 200
    events = [e.removeprefix(b"data: ") for e in response.content.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])
    assert set(error) == {"error"} and error["error"]["code"] == "engine_error"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert texts and all(texts), "tokens before the fault were streamed"


def test_ready_fails_while_the_model_cannot_generate(faulty: InProcessServer) -> None:
    faulty.model.fault = always
    try:
        time.sleep(0.3)  # older than ready_probe_interval_s: /ready must probe for real
        response = httpx.get(f"{faulty.url}/ready", timeout=30)
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "unhealthy" and "probe" in body["detail"]
        assert body["ocm_store"]["healthy"] is True
        assert httpx.get(f"{faulty.url}/health").status_code == 200  # alive, but not ready
    finally:
        faulty.model.fault = None
    assert httpx.get(f"{faulty.url}/ready", timeout=30).status_code == 200  # and it recovers
