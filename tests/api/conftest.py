"""Real servers for the API tests: `python -m service.cli serve` in a subprocess on a free port.

Starting one costs an interpreter, torch and the embedded model (seconds), so the main server is shared by
the whole session; tests that need other settings start their own. Every server gets its own OCM file in
a temporary folder and never sees the developer's CSD_* environment.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEYS = ("sk-test-first-key", "sk-test-second-key")
STARTUP_TIMEOUT_S = 300  # a cold cache converts the GGUF weights first, on a busy 2-core machine
_LISTENING = re.compile(r"on http://([\w.\-\[\]:]+):(\d+) ")


@dataclass
class Server:
    proc: subprocess.Popen
    log_path: Path
    url: str = ""
    api_key: str | None = None
    statuses_before_ready: list[int] = field(default_factory=list)  # /ready answers while it loaded

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 120), **kwargs
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> Metrics:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return Metrics(text)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


class Metrics:
    """A scrape: `m.value("vllm:generation_tokens_total", method="csd")` sums the matching samples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def value(self, name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def server_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CSD_") or k == "CSD_CACHE_DIR"}
    env.update(
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        CSD_OCM_PATH=str(tmp / "ocm.sqlite"),
        PYTHONUNBUFFERED="1",
    )
    return env


def start_server(tmp: Path, *flags: str, api_key: str | None = None, log_level: str = "info") -> Server:
    """Start `csd serve --port 0` and wait until /ready says 200 (fails with the server's log if not)."""
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = tmp / "server.log"
    # One torch thread: on a shared 2-core machine, two threads spin against each other and run 3x slower.
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--port",
        "0",
        "--log-level",
        log_level,
        "--torch-threads",
        "1",
        *flags,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=server_env(tmp), stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, log_path, api_key=api_key)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            if not server.url:
                match = _LISTENING.search(server.log())
                if match:
                    server.url = f"http://{match.group(1)}:{match.group(2)}"
            if server.url:
                try:
                    status = httpx.get(f"{server.url}/ready", timeout=10).status_code
                except httpx.TransportError:
                    status = 0
                if status == 200:
                    return server
                if status:
                    server.statuses_before_ready.append(status)
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{server.log()}")
    except BaseException:
        server.stop(signal.SIGKILL)
        raise


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server: API keys on, token cap 512 (room for generations long enough to act on while they
    run), the default speculation (csd, ngram)."""
    tmp = tmp_path_factory.mktemp("api-server")
    server = start_server(
        tmp,
        *[arg for key in API_KEYS for arg in ("--api-key", key)],
        "--max-tokens-cap", "512", "--default-max-tokens", "16", "--max-queue", "4",
        api_key=API_KEYS[0],
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(api_server: Server) -> openai.OpenAI:
    """The official openai client on the shared server (a module may bring its own)."""
    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS[0], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    """The served model's id, as /v1/models lists it."""
    return client.models.list().data[0].id


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def assert_openai_error(
    response: httpx.Response, status: int, param: str | None = "any", code: str | None = "any"
) -> dict:
    """The response is `status` with exactly OpenAI's error shape; returns the error object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert "Traceback" not in response.text
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    return error


SUFFIX_PROMPT = "Explain in two sentences why the sky is blue."  # an answer that does not repeat itself


def suffix_chat(url: str, key: str) -> dict:
    """A greedy strict-SD chat completion of SUFFIX_PROMPT with the suffix drafter, as `key` (its tenant):
    {"text": ..., and the response's speculative statistics}."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": SUFFIX_PROMPT}],
                "max_tokens": 48,
                "temperature": 0,
                "speculative": {"method": "sd", "drafter": "suffix", "num_speculative_tokens": 16},
            },
        )
    assert response.status_code == 200, response.text
    body = response.json()
    return {"text": body["choices"][0]["message"]["content"], **body["speculative"]}
