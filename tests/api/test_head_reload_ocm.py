"""A reloaded draft head is a new (target, drafter) pair: it starts a fresh OCM namespace, generations in flight
record under it from the swap on, and the retired head's counts come along only with `carry_ocm`
(service/api/head_reload.py). Through a real server, the official `openai` client and GET /v1/ocm/top."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from service.decoding.draft_head import EMBEDDED_HEAD_DIR, RecurrentDraftHead
from tests.api.conftest import Server, start_server

MODEL = "SmolLM2-135M-Instruct"
CSD = {"speculative": {"method": "csd", "drafter": "head", "lambda": 0}, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("reload-ocm"), "--max-tokens-cap", "64")
    yield server
    server.stop()


def _head(folder: Path, scale: float) -> Path:
    """The shipped head with one block's weights scaled: a valid head with its own identity."""
    head = RecurrentDraftHead.load(EMBEDDED_HEAD_DIR)
    with torch.no_grad():
        next(p for p in head.parameters() if p.dim() == 2).mul_(scale)
    head.save(folder)
    return folder


def _head_namespace(server: Server) -> tuple[str, dict[tuple[int, int], int]]:
    """The `head` drafter's OCM namespace key and its patterns' counts."""
    with server.client() as http:
        data = http.get("/v1/ocm/top", params={"n": 1000}).json()["data"]
    (entry,) = [d for d in data if d["drafter"] == "head"]
    return entry["namespace"], {(p["draft_token"], p["target_token"]): p["count"] for p in entry["patterns"]}


def _reload(server: Server, **body) -> dict:
    answer = httpx.post(f"{server.url}/v1/admin/reload_drafter", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_reloaded_head_counts_in_a_fresh_namespace_and_carries_counts_only_when_asked(
    server: Server, tmp_path: Path
) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=48, temperature=0, extra_body=CSD
    )
    shipped, shipped_counts = _head_namespace(server)
    assert shipped_counts, "the shipped head's rejections are counted"

    # another head is another pair: it starts with no counts
    body = _reload(server, folder=str(_head(tmp_path / "a", 0.9)))
    fresh, fresh_counts = _head_namespace(server)
    assert fresh != shipped and fresh in body["ocm_namespaces"] and body["ocm_patterns_carried"] == 0
    assert fresh_counts == {}

    # a stream runs across a reload: its rounds after the swap count for the new pair
    reloaded: list[dict] = []
    folder = str(_head(tmp_path / "b", 0.8))
    reloader = threading.Thread(target=lambda: reloaded.append(_reload(server, folder=folder)))
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0, stream=True, extra_body=CSD
    )
    for chunk in stream:
        if chunk.choices and not reloaded and not reloader.is_alive():
            reloader.start()
    reloader.join(60)
    (body,) = reloaded
    swapped, swapped_counts = _head_namespace(server)
    assert swapped not in (shipped, fresh) and swapped in body["ocm_namespaces"]
    assert swapped_counts, "the stream in flight records its divergences under the new head's namespace"

    # an explicit carry-over: the new namespace starts with exactly the retired one's counts
    body = _reload(server, folder=str(_head(tmp_path / "c", 0.7)), carry_ocm=True)
    carried, carried_counts = _head_namespace(server)
    assert carried not in (shipped, fresh, swapped) and carried in body["ocm_namespaces"]
    assert carried_counts == swapped_counts
    assert body["ocm_patterns_carried"] >= len(swapped_counts)  # `combined`'s namespace is carried too

    # the same weights again are the same pair: nothing changes
    body = _reload(server, folder=str(tmp_path / "c"))
    assert body["ocm_namespaces"] == [] and _head_namespace(server) == (carried, carried_counts)
