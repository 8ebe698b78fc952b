"""Engine failures, which no valid request can cause: injected into the real model by named fakes.

The app runs in a real uvicorn server (in a thread of this process, so the test can switch the fault on
and off) on the real embedded model; only the model's forward (`FaultInjectingModel`), the n-gram drafter's
proposals (`FaultInjectingDrafter`) and the tokenizer's `decode` (`failing_decode`) are wrapped. A fault
fails the requests it touched and no other; an engine that cannot go on says so on /health and /ready, and
`csd serve` (a real subprocess) exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from ocm_store.base import Namespace
from ocm_store.memory import InMemoryStore
from service.api import create_app
from service.api.server import bind_socket
from service.api.worker import MAX_CONSECUTIVE_FAULTS
from service.config import Settings
from service.decoding import Engine, LoadedModel, NgramDrafter, vocabulary_hash
from service.decoding.drafters.base import Draft, DraftRow
from service.decoding.text import encode_prompt
from service.runtime import Runtime
from tests.api.conftest import _LISTENING, REPO_ROOT, assert_openai_error, server_env, wait_until

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


class FaultInjectingDrafter:
    """FAKE: the real n-gram drafter, except that a round's proposals raise while `fault(row)` says so for
    one of its rows (as a drafter's bug would, for all the rows of the call)."""

    def __init__(self, drafter: NgramDrafter) -> None:
        self._drafter = drafter
        self.name = drafter.name
        self.fault: Callable[[DraftRow], bool] | None = None
        self.raised_for: list[int] = []  # how many rows each failing call held

    @property
    def identity(self) -> str:
        return self._drafter.identity

    def rows(self) -> _FaultInjectingRows:
        return _FaultInjectingRows(self, self._drafter.rows())


class _FaultInjectingRows:
    def __init__(self, drafter: FaultInjectingDrafter, rows) -> None:
        self._drafter = drafter
        self._rows = rows

    def prefill(self, sequence: object, tokens: Sequence[int]) -> None:
        self._rows.prefill(sequence, tokens)

    def leave(self, sequence: object) -> None:
        self._rows.leave(sequence)

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        fault = self._drafter.fault
        if fault is not None and any(fault(row) for row in rows):
            self._drafter.raised_for.append(len(rows))
            raise InjectedFault("injected fault: the drafter failed")
        return self._rows.propose(rows)


@dataclass
class InProcessServer:
    url: str
    model: FaultInjectingModel
    drafter: FaultInjectingDrafter
    target: LoadedModel


@contextlib.contextmanager
def in_process_server(embedded: LoadedModel, folder: Path) -> Iterator[InProcessServer]:
    """A real uvicorn server in a thread, on the embedded model with the faults above switched off."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess servers: two threads crawl on a shared 2-core machine
    model = FaultInjectingModel(embedded.model)
    target = LoadedModel(
        name=embedded.name, model=model, tokenizer=embedded.tokenizer, revision=embedded.revision
    )  # type: ignore[arg-type]
    settings = Settings(
        ready_probe_interval_s=0.2, ready_probe_timeout_s=20, max_tokens_cap=64, drafter="ngram"
    )
    store = InMemoryStore(path=folder / "ocm.sqlite")
    drafter = FaultInjectingDrafter(NgramDrafter())
    namespaces = {
        "ngram": Namespace(f"{target.name}@{target.revision}", "ngram", vocabulary_hash(target.tokenizer))
    }
    engine = Engine(target, {"ngram": drafter}, {"ngram": store.memory(namespaces["ngram"])})  # type: ignore[dict-item]
    runtime = Runtime(settings, target, engine, store, namespaces)
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(create_app(settings, runtime), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        assert wait_until(lambda: _status(url, "/ready") == 200, timeout=120)
        yield InProcessServer(url, model, drafter, target)
    finally:
        server.should_exit = True
        thread.join(30)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def faulty(embedded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    with in_process_server(embedded, tmp_path_factory.mktemp("faults")) as server:
        yield server


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


# ---------------------------------------------------------------- a fault among streams in flight

# completions of text that goes on (a finished sentence may end at once)
OTHERS = ["The three primary colours are", "Counting from one to ten: one, two,", "The days of the week are"]
FAULTED = "Once upon a time, a parrot"


def _body(prompt: str, stream: bool = True) -> dict:
    # sd: lossless, so at temperature 0 a stream's text is the target's greedy text whatever else runs
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 24,
        "stream": stream,
        "speculative": {"method": "sd", "drafter": "ngram"},
    }


@dataclass
class Answer:
    status: int
    events: list  # a stream's events (JSON objects, then "[DONE]"); a plain response's one JSON body
    seconds: float

    @property
    def text(self) -> str:
        """A stream's text, up to an error event."""
        return "".join(e["choices"][0]["text"] for e in self.events if isinstance(e, dict) and "choices" in e)


async def _ask(http: httpx.AsyncClient, body: dict) -> Answer:
    started = time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        raw = await response.aread()
    if not body["stream"] or not raw.startswith(b"data: "):
        return Answer(response.status_code, [json.loads(raw)], time.monotonic() - started)
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    parsed = [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]
    return Answer(response.status_code, parsed, time.monotonic() - started)


def _ask_together(url: str, bodies: list[dict]) -> list[Answer]:
    """All requests at once, as concurrent clients (they share the engine's batch)."""

    async def run() -> list[Answer]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*(_ask(http, b) for b in bodies))

    return asyncio.run(run())


def _assert_intact(answers: list[Answer], reference: list[Answer]) -> None:
    """The other streams ended as a fault-free run's did: 200, their whole text, a finish_reason, [DONE]."""
    for answer, fault_free in zip(answers, reference, strict=True):
        assert answer.status == 200 and answer.events[-1] == "[DONE]", answer.events[-3:]
        assert not any("error" in e for e in answer.events if isinstance(e, dict)), answer.events
        assert answer.text == fault_free.text and answer.text
        assert answer.events[-2]["choices"][0]["finish_reason"] is not None


def test_a_drafter_failing_mid_round_fails_only_its_stream(faulty: InProcessServer) -> None:
    bodies = [_body(p) for p in OTHERS + [FAULTED]]
    reference = _ask_together(faulty.url, bodies)
    assert all(a.status == 200 and a.text for a in reference)
    prompt = encode_prompt(faulty.target.tokenizer, FAULTED)

    def mid_stream(row: DraftRow) -> bool:  # the faulted stream's row, once it has 4 tokens out
        return list(row.committed[: len(prompt)]) == prompt and len(row.committed) >= len(prompt) + 4

    faulty.drafter.fault, faulty.drafter.raised_for = mid_stream, []
    try:
        *others, faulted = _ask_together(faulty.url, bodies)
    finally:
        faulty.drafter.fault = None
    # the drafter raised for a call holding other streams' rows too, and only the faulted one failed
    assert faulty.drafter.raised_for and max(faulty.drafter.raised_for) > 1, faulty.drafter.raised_for
    _assert_intact(others, reference[:-1])
    assert faulted.status == 200 and faulted.events[-1] == "[DONE]"
    assert faulted.events[-2]["error"]["code"] == "engine_error"
    assert faulted.text and reference[-1].text.startswith(faulted.text)  # the tokens before the fault
    assert faulted.text != reference[-1].text
    after = _ask_together(faulty.url, [_body(FAULTED)])  # and the server keeps serving
    assert after[0].status == 200 and after[0].text == reference[-1].text


def test_a_failing_detokenisation_fails_only_its_request(
    faulty: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = faulty.target.tokenizer
    faulted_prompt = FAULTED + " \U0001f99c"  # the parrot's odd bytes: the prompt's last tokens
    odd = set(encode_prompt(tokenizer, faulted_prompt)) - set(encode_prompt(tokenizer, FAULTED))
    assert odd and not odd & {t for p in OTHERS for t in encode_prompt(tokenizer, p)}
    real_decode = tokenizer.decode

    def failing_decode(ids, *args, **kwargs):
        """FAKE: the tokenizer's decode, failing on the engine thread for a text with the parrot's bytes
        (the first detokenisation of the faulted request: its window holds the prompt's last tokens)."""
        if threading.current_thread().name == "csd-engine" and odd & set(ids):
            raise UnicodeDecodeError("utf-8", b"\xf0\x9f", 0, 2, "injected fault: odd bytes")
        return real_decode(ids, *args, **kwargs)

    bodies = [_body(p) for p in OTHERS] + [_body(faulted_prompt, stream=False)]
    reference = _ask_together(faulty.url, bodies)
    assert all(a.status == 200 for a in reference)
    monkeypatch.setattr(tokenizer, "decode", failing_decode)
    *others, faulted = _ask_together(faulty.url, bodies)
    monkeypatch.undo()
    _assert_intact(others, reference[:-1])
    assert faulted.status == 500
    error = faulted.events[0]["error"]
    assert error["code"] == "engine_error" and error["type"] == "server_error"
    after = _ask_together(faulty.url, [_body(faulted_prompt, stream=False)])  # the server keeps serving
    assert after[0].status == 200 and after[0].text == reference[-1].text


# ---------------------------------------------------------------- an engine that cannot go on


def test_an_engine_that_keeps_failing_is_dead_for_health_and_ready(
    embedded: LoadedModel, tmp_path: Path
) -> None:
    with in_process_server(embedded, tmp_path) as server:  # its own: this one does not come back
        server.model.fault = always  # the model fails every forward: nothing can succeed any more
        body = _body("Hello there", stream=False)
        answers = _ask_together(server.url, [body] * (MAX_CONSECUTIVE_FAULTS + 2))
        # one fault per engine step (each request fails in its own prefill) until the engine gives up:
        # the requests still waiting then are answered at once, not at their timeout
        statuses = sorted(a.status for a in answers)
        assert statuses == [500] * MAX_CONSECUTIVE_FAULTS + [503, 503], statuses
        for answer in answers:
            code = answer.events[0]["error"]["code"]
            assert code == ("engine_error" if answer.status == 500 else "engine_dead")
            assert answer.seconds < 30
        for path in ("/health", "/ready"):
            response = httpx.get(server.url + path, timeout=30)
            assert response.status_code == 503, path
            assert response.json()["status"] == "dead" and "engine dead" in response.json()["detail"]
        server.model.fault = None  # even a model that works again: only a restart brings it back
        refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert_openai_error(refused, 503, code="engine_dead")


# FAKE: `csd serve` with a fault in the engine loop itself (not in a request's work) once the file named by
# CSD_TEST_LOOP_FAULT exists: which no real input can cause.
DYING_SERVE = """
import os, sys
from service.decoding import engine
real_step = engine.EngineCore.step
def step(self):
    if os.path.exists(os.environ["CSD_TEST_LOOP_FAULT"]):
        raise RuntimeError("injected fault in the engine loop")
    return real_step(self)
engine.EngineCore.step = step
from service.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_csd_serve_exits_non_zero_when_its_engine_dies(tmp_path: Path) -> None:
    flag = tmp_path / "fail-the-loop"
    env = server_env(tmp_path) | {"CSD_TEST_LOOP_FAULT": str(flag)}
    cmd = [sys.executable, "-c", DYING_SERVE, "serve", "--port", "0", "--torch-threads", "1"]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = ""

        def ready() -> bool:
            nonlocal url
            assert proc.poll() is None, log_path.read_text()
            match = _LISTENING.search(log_path.read_text(errors="replace"))
            url = f"http://{match.group(1)}:{match.group(2)}" if match else ""
            return bool(url) and _status(url, "/ready") == 200

        assert wait_until(ready, timeout=300, interval=0.2), log_path.read_text()
        flag.touch()
        body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}
        # the request the loop was woken for is answered (a 503: retry elsewhere), not left to time out
        assert_openai_error(
            httpx.post(f"{url}/v1/completions", json=body, timeout=60), 503, code="engine_dead"
        )
        assert proc.wait(timeout=60) != 0  # so that Kubernetes restarts it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    output = log_path.read_text(errors="replace")
    assert "the engine is dead" in output and "the engine died" in output.strip().splitlines()[-1]
