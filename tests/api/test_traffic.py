"""Traffic recording (service/traffic.py) and draft head reload (service/api/head_reload.py), through real
servers and the official `openai` client.

- off by default: a server without the switch records nothing and exports no recording metric;
- on: each finished generation's record holds the prompt ids /tokenize gives and the ids that were
  returned (the end-of-turn token appended when it ended on one); no text;
- the size bound stops recording (once in the log, in a metric) and never fails a request;
- a folder that cannot be written degrades the same way (a real OS error: its parent is a file);
- a reload swaps the head between rounds: a strict-sd stream running across it finishes with exactly the
  greedy text; /metrics names the new head after; a bad head is refused and the old one keeps serving.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from service.decoding.draft_head import EMBEDDED_HEAD_DIR, RecurrentDraftHead
from service.traffic import SHARD_GLOB, read_traffic
from tests.api.conftest import REPO_ROOT, Server, start_server, wait_until

MODEL = "SmolLM2-135M-Instruct"
BOUND = 3000  # bytes: room for a few records, then the bound stops recording
STRICT = {"speculative": {"method": "sd", "return_provenance": True}}


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("traffic-server")
    folder = tmp / "traffic"
    server = start_server(
        tmp,
        "--record-traffic",
        str(folder),
        "--record-traffic-max-bytes",
        str(BOUND),
        "--max-tokens-cap",
        "64",
    )
    yield server, folder
    server.stop()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _records(folder: Path, count: int) -> list[dict]:
    assert wait_until(lambda: len(list(read_traffic(folder))) >= count, timeout=30), list(
        read_traffic(folder)
    )
    return list(read_traffic(folder))


def test_recording_is_off_by_default(api_server: Server) -> None:
    with api_server.client() as http:
        answer = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert answer.status_code == 200
    metrics = api_server.metrics()
    assert not {n for n in metrics.names() if n.startswith("csd_traffic")}
    written = [*api_server.log_path.parent.rglob(SHARD_GLOB), *REPO_ROOT.glob(SHARD_GLOB)]
    assert written == []
    assert "recording served token ids" not in api_server.log()


def test_records_hold_the_ids_served_and_no_text(recording: tuple[Server, Path]) -> None:
    server, folder = recording
    client = _client(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=48, temperature=0, extra_body=STRICT
    )
    prompt = "The capital of France is"
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=STRICT
    )
    records = _records(folder, 2)
    assert len(records) == 2
    with httpx.Client(base_url=server.url, timeout=60) as http:
        chat_prompt = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
        text_prompt = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
        im_end = http.post("/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    by_prompt = {tuple(r["prompt_ids"]): r for r in records}
    assert set(by_prompt) == {tuple(chat_prompt), tuple(text_prompt)}

    chat_record = by_prompt[tuple(chat_prompt)]
    served = [t["id"] for t in chat.model_extra["speculative"]["tokens"]]
    assert chat.choices[0].finish_reason == "stop", "the colour answer should end its turn within 48 tokens"
    assert chat_record["answer_ids"] == served + im_end  # the end-of-turn token the target chose, appended
    assert chat_record["finish_reason"] == "stop"
    completion_record = by_prompt[tuple(text_prompt)]
    assert completion_record["answer_ids"] == [
        t["id"] for t in completion.model_extra["speculative"]["tokens"]
    ]
    assert completion_record["finish_reason"] == "length" and len(completion_record["answer_ids"]) == 6
    for record in records:
        assert record["model"].startswith(f"{MODEL}@") and len(record["model"]) > len(MODEL) + 1
        assert record["method"] == "sd" and record["drafter"] == "combined"
        assert record["drafter_identity"].startswith("combined:ngram")
        assert not any(isinstance(v, str) and " " in v for v in record.values())  # ids, never text
    raw = b"".join(p.read_bytes() for p in folder.rglob(SHARD_GLOB))
    assert b"France" not in raw and b"colour" not in raw.lower()  # compressed, and text-free anyway
    assert "France" not in server.log()


def _different_head(folder: Path) -> Path:
    """The shipped head with one block's weights scaled: a valid head with a different identity."""
    head = RecurrentDraftHead.load(EMBEDDED_HEAD_DIR)
    with torch.no_grad():
        next(p for p in head.parameters() if p.dim() == 2).mul_(0.9)
    head.save(folder)
    return folder


def test_a_reload_during_a_stream_keeps_it_exact(recording: tuple[Server, Path], tmp_path: Path) -> None:
    server, _ = recording
    client = _client(server)
    new_head = _different_head(tmp_path / "head-new")
    before = server.metrics()
    old_identity = next(s.labels["identity"] for s in before.samples if s.name == "csd_draft_head_info")
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    spec = {"speculative": {"method": "sd", "drafter": "head"}, "ignore_eos": True}
    greedy = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0, extra_body=spec
    )
    reloaded: list[httpx.Response] = []
    chunks_after: list[int] = []
    texts: list[str] = []
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0, stream=True, extra_body=spec
    )
    thread = None
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        texts.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
        if thread is None:  # the generation is running: reload now
            thread = threading.Thread(
                target=lambda: reloaded.append(
                    httpx.post(
                        f"{server.url}/v1/admin/reload_drafter", json={"folder": str(new_head)}, timeout=60
                    )
                )
            )
            thread.start()
        elif reloaded:
            chunks_after.append(1)
    assert thread is not None
    thread.join(60)
    assert reloaded and reloaded[0].status_code == 200, reloaded and reloaded[0].text
    body = reloaded[0].json()
    assert body["previous_identity"] == old_identity and body["identity"] != old_identity
    assert chunks_after, "the reload should land while the stream is still running"
    assert finish == "length"
    assert "".join(texts) == greedy.choices[0].message.content  # strict sd: the swap changed no token
    metrics = server.metrics()
    identities = [s.labels["identity"] for s in metrics.samples if s.name == "csd_draft_head_info"]
    assert identities == [body["identity"]]
    assert metrics.value("csd_draft_head_reloads_total", outcome="ok") == 1
    after = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body=spec
    )
    assert after.model_extra["speculative"]["draft_tokens"] > 0  # the new head drafts


def test_a_bad_head_is_refused_and_the_old_one_keeps_serving(
    recording: tuple[Server, Path], tmp_path: Path
) -> None:
    server, _ = recording
    serving = [s.labels["identity"] for s in server.metrics().samples if s.name == "csd_draft_head_info"]
    wrong_vocab = tmp_path / "wrong-vocab"
    shutil.copytree(EMBEDDED_HEAD_DIR, wrong_vocab)
    config = json.loads((wrong_vocab / "config.json").read_text())
    config["target_vocab_hash"] = "0000000000000000"
    (wrong_vocab / "config.json").write_text(json.dumps(config))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(EMBEDDED_HEAD_DIR, corrupt)
    (corrupt / "model.safetensors").write_bytes((corrupt / "model.safetensors").read_bytes()[:1000])
    cases = [(wrong_vocab, "vocabulary"), (corrupt, "Safetensor"), (tmp_path / "missing", "not a folder")]
    for folder, reason in cases:
        answer = httpx.post(f"{server.url}/v1/admin/reload_drafter", json={"folder": str(folder)}, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "invalid_draft_head" and error["param"] == "folder"
        assert reason in error["message"] and "keeps serving" in error["message"]
    metrics = server.metrics()
    assert [s.labels["identity"] for s in metrics.samples if s.name == "csd_draft_head_info"] == serving
    assert metrics.value("csd_draft_head_reloads_total", outcome="failed") == len(cases)
    answer = _client(server).completions.create(model=MODEL, prompt="One, two,", max_tokens=4)
    assert answer.choices[0].text


def test_the_size_bound_stops_recording_and_no_request_fails(recording: tuple[Server, Path]) -> None:
    server, folder = recording
    client = _client(server)
    for i in range(40):  # each record is a few hundred compressed bytes: the bound is met well before
        answer = client.completions.create(model=MODEL, prompt=f"Item {i}: a", max_tokens=8, temperature=0)
        assert answer.choices[0].text is not None
        if server.metrics().value("csd_traffic_recording_active") == 0:
            break
    assert wait_until(lambda: server.metrics().value("csd_traffic_recording_active") == 0, timeout=30)
    written = sum(p.stat().st_size for p in folder.rglob(SHARD_GLOB))
    metrics = server.metrics()
    assert 0 < written <= BOUND and metrics.value("csd_traffic_bytes_total") == written
    assert metrics.value("csd_traffic_dropped_records_total", reason="size_bound") >= 1
    assert server.log().count("traffic recording stopped (size bound)") == 1
    recorded = len(list(read_traffic(folder)))
    assert recorded == metrics.value("csd_traffic_records_total")
    client.completions.create(model=MODEL, prompt="After the bound,", max_tokens=4)
    time.sleep(0.5)
    assert len(list(read_traffic(folder))) == recorded  # nothing more once stopped
    assert server.log().count("traffic recording stopped") == 1


def test_a_folder_that_cannot_be_written_never_fails_a_request(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the recording folder's parent should be")
    server = start_server(tmp_path / "server", "--record-traffic", str(blocker / "traffic"))
    try:
        client = _client(server)
        for _ in range(2):
            assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).choices[0].text
        assert wait_until(lambda: server.metrics().value("csd_traffic_recording_active") == 0, timeout=30)
        metrics = server.metrics()
        assert metrics.value("csd_traffic_dropped_records_total", reason="write_failed") == 1
        assert server.log().count("traffic recording stopped (write failed)") == 1
        assert "Traceback" not in server.log()
    finally:
        server.stop()


def test_the_whole_loop_record_fine_tune_reload(
    recording: tuple[Server, Path], embedded, tmp_path: Path
) -> None:
    """Tiny mode of `python -m training --from-traffic`: the records this module's requests left, a few
    fine-tuning steps, and a reload of the result into the server that recorded them."""
    from training.traffic import fine_tune, fine_tune_config

    server, folder = recording
    records = list(read_traffic(folder))
    config = fine_tune_config(epochs=1.0, batch_size=32, warmup_steps=1, eval_positions=64)
    torch.set_num_threads(1)
    report = fine_tune(embedded, folder, EMBEDDED_HEAD_DIR, tmp_path / "traffic-head", config, holdout=0.3)
    assert report["records"]["usable"] + sum(report["records"]["skipped"].values()) == len(records)
    assert report["records"]["train"] >= 1 and report["records"]["held_out"] >= 1
    assert report["steps"] >= 1 and report["before"]["positions"] == report["after"]["positions"] > 0
    assert (tmp_path / "traffic-head" / "traffic.json").exists()
    answer = httpx.post(
        f"{server.url}/v1/admin/reload_drafter", json={"folder": str(tmp_path / "traffic-head")}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["identity"].startswith("head:traffic-head@")
    spec = {"speculative": {"method": "sd", "drafter": "head"}}
    after = _client(server).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, extra_body=spec
    )
    assert after.model_extra["speculative"]["draft_tokens"] > 0


def test_sighup_reloads_the_head_from_its_folder(recording: tuple[Server, Path]) -> None:
    server, _ = recording
    reloads = server.metrics().value("csd_draft_head_reloads_total", outcome="ok")
    server.proc.send_signal(signal.SIGHUP)
    assert wait_until(
        lambda: server.metrics().value("csd_draft_head_reloads_total", outcome="ok") == reloads + 1,
        timeout=30,
    ), server.log()
    assert "SIGHUP: draft head reloaded" in server.log()
    assert server.proc.poll() is None  # the signal reloads, it does not stop the server
