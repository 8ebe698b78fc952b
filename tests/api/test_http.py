"""The wire format with plain httpx: SSE framing, usage and speculative fields, auth, metrics (cancellation on
every API: test_one_driver.py)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.api.conftest import API_KEYS, Server, assert_openai_error, wait_until

MODEL = "SmolLM2-135M-Instruct"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # the model keeps counting: long, steady generations
PROVENANCES = {"accepted", "rescued", "recovered", "bonus", "plain"}


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body into its `data:` payloads, checking the framing on the way."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = raw[:-2].split(b"\n\n")
    for event in events:
        assert event.startswith(b"data: ") and b"\n" not in event, event
    return [event[len(b"data: ") :] for event in events]


def test_completion_stream_is_framed_as_sse_ending_with_done(api_server: Server) -> None:
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 8, "stream": True}
    with api_server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        raw = response.read()
    payloads = sse_events(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and chunk["model"] == MODEL
        assert isinstance(chunk["created"], int)
        assert "usage" not in chunk  # only with stream_options.include_usage
        assert [c["index"] for c in chunk["choices"]] == [0]
    *text_chunks, last = chunks
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks)
    assert last["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    assert last["speculative"]["method"] == "csd"


def test_chat_stream_usage_chunk_and_speculative_statistics(api_server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Count from 1 to 20."}]}],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": {"method": "sd", "num_speculative_tokens": 3},
    }
    with api_server.client() as http:
        raw = http.post("/v1/chat/completions", json=body).content
    payloads = sse_events(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    first, *middle, finish, usage_chunk = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in [first, *middle, finish])
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in middle)
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    spec = usage_chunk["speculative"]
    assert spec == finish["speculative"]
    # the default drafter on the embedded model: prompt lookup where it matches, else the trained head
    assert spec["method"] == "sd" and spec["drafter"] == "combined" and spec["num_speculative_tokens"] == 3
    assert spec["accepted_tokens"] + spec["rescued_tokens"] <= spec["draft_tokens"]
    assert spec["rescued_tokens"] == 0  # strict speculative decoding never rescues
    assert spec["tokens_per_forward"] == pytest.approx(12 / spec["target_forwards"], abs=1e-3)
    if spec["draft_tokens"]:
        kept = spec["accepted_tokens"] + spec["rescued_tokens"]
        assert spec["kept_rate"] == pytest.approx(kept / spec["draft_tokens"], abs=1e-3)
        assert spec["acceptance_rate"] == pytest.approx(
            spec["accepted_tokens"] / spec["draft_tokens"], abs=1e-3
        )


def test_the_tokens_per_forward_metric_agrees_with_the_response_when_a_stop_string_cuts(
    api_server: Server,
) -> None:
    """One definition: a round cut by a stop string counts the tokens it emitted, in the response and in
    csd_tokens_per_target_forward alike."""
    labels = {"method": "sd", "drafter": "combined"}
    name = "csd_tokens_per_target_forward"
    before = api_server.metrics()
    # the colours repeat, so prompt lookup drafts through " blue" and the stop string cuts a kept draft token
    prompt = "Repeat: red, green, blue, red, green, blue, red, green, blue, red, green, blue, red,"
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 40,
        "stop": [" blue"],
        "speculative": {"method": "sd"},
    }
    with api_server.client() as http:
        data = http.post("/v1/completions", json=body).json()
    after = api_server.metrics()
    assert data["choices"][0]["finish_reason"] == "stop" and "blue" not in data["choices"][0]["text"]
    spec = data["speculative"]
    total = after.value(f"{name}_sum", **labels) - before.value(f"{name}_sum", **labels)
    rounds = after.value(f"{name}_count", **labels) - before.value(f"{name}_count", **labels)
    assert rounds == spec["target_forwards"]
    assert total / rounds == pytest.approx(spec["tokens_per_forward"], abs=1e-3)


def test_vanilla_request_reports_no_speculation(api_server: Server) -> None:
    body = {"model": "embedded", "prompt": COUNTING, "max_tokens": 6, "speculative": {"method": "vanilla"}}
    with api_server.client() as http:
        data = http.post("/v1/completions", json=body).json()
    assert data["model"] == MODEL  # the request may use the spec the server was started with
    spec = data["speculative"]
    assert spec["method"] == "vanilla" and spec["drafter"] is None and spec["num_speculative_tokens"] == 0
    assert spec["draft_tokens"] == 0 and spec["target_forwards"] == data["usage"]["completion_tokens"]
    assert spec["tokens_per_forward"] == 1.0


def test_provenance_of_every_token_when_asked(api_server: Server) -> None:
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 10, "speculative": {"return_provenance": True}}
    with api_server.client() as http:
        data = http.post("/v1/completions", json=body).json()
        tokens = data["speculative"]["tokens"]
        assert len(tokens) == data["usage"]["completion_tokens"]
        assert {t["provenance"] for t in tokens} <= PROVENANCES
        assert all(isinstance(t["id"], int) and isinstance(t["text"], str) for t in tokens)
        assert "".join(t["text"] for t in tokens).strip() == data["choices"][0]["text"].strip()

        raw = http.post("/v1/completions", json={**body, "stream": True}).content
    chunks = [json.loads(p) for p in sse_events(raw)[:-1]]
    streamed = [t for c in chunks[:-1] for t in c["speculative"]["tokens"]]
    assert [t["id"] for t in streamed] == [t["id"] for t in tokens]  # greedy: the same tokens, same order
    assert "tokens" not in chunks[-1]["speculative"]  # the finish chunk carries the statistics
    # Each round's chunk says how many draft tokens it verified: they add up to the total.
    assert (
        sum(c["speculative"]["draft_tokens"] for c in chunks[:-1])
        == chunks[-1]["speculative"]["draft_tokens"]
    )


def test_api_keys(api_server: Server) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=api_server.url, timeout=60) as http:
        missing = http.post("/v1/completions", json=body)
        error = assert_openai_error(missing, 401, code="invalid_api_key")
        assert missing.headers["www-authenticate"] == "Bearer"
        assert "Authorization" in error["message"]
        wrong = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-test-wrong-key"})
        assert_openai_error(wrong, 401, code="invalid_api_key")
        basic = http.get("/v1/models", headers={"Authorization": f"Basic {API_KEYS[0]}"})
        assert_openai_error(basic, 401)
        for key in API_KEYS:
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # Probes and scrapes need no key.
        for path in ("/health", "/ready", "/metrics"):
            assert http.get(path).status_code == 200, path
    log = api_server.log()
    assert "POST /v1/completions" in log  # the access log is on, and still:
    for secret in (*API_KEYS, "sk-test-wrong-key"):
        assert secret not in log


def test_health_and_ready_bodies(api_server: Server) -> None:
    assert 503 in api_server.statuses_before_ready, "/ready should have said 503 while the model loaded"
    assert httpx.get(f"{api_server.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{api_server.url}/ready").json()
    assert ready["status"] == "ready" and ready["model"] == MODEL
    assert ready["ocm_store"]["backend"] == "memory" and ready["ocm_store"]["healthy"] is True
    assert ready["requests"] == {"running": 0, "waiting": 0}


def test_ocm_top_lists_patterns_decoded(api_server: Server) -> None:
    with api_server.client() as http:
        # csd (the server's default method) records every rejection it meets in the OCM. Whether a request
        # speculates is the draft policy's choice from the forward costs it measured at start (on a busy host
        # it may decode plainly at first, exploring now and then): a few requests meet rejections
        for _ in range(6):
            done = http.post(
                "/v1/completions", json={"model": MODEL, "prompt": COUNTING, "max_tokens": 12}
            ).json()
            if done["speculative"]["recovered_tokens"] > 0:
                break
        assert done["speculative"]["recovered_tokens"] > 0, "this prompt should meet rejections"
        response = http.get("/v1/ocm/top", params={"n": 5})
        assert response.status_code == 200
        data = response.json()["data"]
        # one namespace per drafter this server built (patterns are per model pair): the registry's available
        # ones, which it lists; the default drafter met the rejections
        built = [d["id"] for d in http.get("/v1/drafters").json()["data"] if d["available"]]
        assert [entry["drafter"] for entry in data] == sorted(built)
        assert {"combined", "head", "ngram"} <= set(built)
        by_drafter = {entry["drafter"]: entry for entry in data}
        assert "|combined:ngram+head:" in by_drafter["combined"]["namespace"]
        assert "|ngram|" in by_drafter["ngram"]["namespace"]
        patterns = by_drafter["combined"]["patterns"]
        assert 1 <= len(patterns) <= 5
        assert [p["count"] for p in patterns] == sorted((p["count"] for p in patterns), reverse=True)
        for p in patterns:
            assert set(p) == {"draft_token", "target_token", "draft_text", "target_text", "count"}
        assert_openai_error(http.get("/v1/ocm/top", params={"n": 0}), 400, param="n")
        assert_openai_error(httpx.get(f"{api_server.url}/v1/ocm/top"), 401)


def test_metrics_count_a_request(api_server: Server) -> None:
    labels = {"method": "csd", "drafter": "combined"}
    before = api_server.metrics()
    with api_server.client() as http:
        data = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": COUNTING, "max_tokens": 12}
        ).json()
        http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    httpx.post(f"{api_server.url}/v1/completions", json={})  # 401
    after = api_server.metrics()

    def delta(name: str, **extra: str) -> float:
        return after.value(name, **extra) - before.value(name, **extra)

    spec, usage = data["speculative"], data["usage"]
    assert delta("csd_requests_total", endpoint="/v1/completions", status_code="200") == 1
    assert delta("csd_requests_total", endpoint="/v1/completions", status_code="404") == 1
    assert delta("csd_requests_total", endpoint="/v1/completions", status_code="401") == 1
    assert delta("vllm:generation_tokens_total", **labels) == usage["completion_tokens"]
    assert delta("vllm:prompt_tokens_total", **labels) == usage["prompt_tokens"]
    assert delta("csd_target_forwards_total", **labels) == spec["target_forwards"]
    assert delta("vllm:spec_decode_num_draft_tokens_total", **labels) == spec["draft_tokens"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total", **labels) == spec["accepted_tokens"]
    assert delta("csd_spec_decode_num_rescued_tokens_total", **labels) == spec["rescued_tokens"]
    assert delta("csd_spec_decode_num_recovered_tokens_total", **labels) == spec["recovered_tokens"]
    assert delta("csd_spec_decode_num_bonus_tokens_total", **labels) == spec["bonus_tokens"]
    # per position: accepted counts accepted tokens only (vLLM's), kept adds the rescued ones
    assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", **labels) == spec["accepted_tokens"]
    kept = delta("csd_spec_decode_num_kept_tokens_per_pos_total", **labels)
    assert kept == spec["accepted_tokens"] + spec["rescued_tokens"]
    assert delta("vllm:time_to_first_token_seconds_count", **labels) == 1
    assert delta("vllm:e2e_request_latency_seconds_count", **labels) == 1
    assert delta("vllm:inter_token_latency_seconds_count", **labels) == spec["target_forwards"] - 1
    # vLLM's per-request series: one finished request, by its finish reason, its phases and its sizes
    finish = data["choices"][0]["finish_reason"]
    assert delta("vllm:request_success_total", **labels, finished_reason=finish) == 1
    assert delta("vllm:request_success_total", **labels) == 1
    for phase in ("queue", "inference", "prefill", "decode"):
        assert delta(f"vllm:request_{phase}_time_seconds_count", **labels) == 1, phase
    inference = delta("vllm:request_inference_time_seconds_sum", **labels)
    parts = delta("vllm:request_prefill_time_seconds_sum", **labels) + delta(
        "vllm:request_decode_time_seconds_sum", **labels
    )
    assert abs(inference - parts) < 1e-6  # inference = prefill + decode, as in vLLM
    assert delta("vllm:request_prompt_tokens_sum", **labels) == usage["prompt_tokens"]
    assert delta("vllm:request_generation_tokens_sum", **labels) == usage["completion_tokens"]
    assert delta("vllm:request_time_per_output_token_seconds_count", **labels) == 1
    assert delta("csd_tokens_per_target_forward_count", **labels) == spec["target_forwards"]
    assert delta("csd_tokens_per_target_forward_sum", **labels) >= usage["completion_tokens"]
    assert after.value("vllm:num_requests_running") == 0 and after.value("vllm:num_requests_waiting") == 0
    assert after.value("csd_ocm_store_healthy", backend="memory") == 1
    for name in (
        "csd_ocm_patterns", "csd_ocm_buffered_increments", "csd_ocm_dropped_increments_total", "csd_ocm_evicted_patterns_total",
        "csd_ocm_reconnects_total", "csd_ocm_flush_seconds_count", "csd_ocm_flush_seconds_sum",
        "csd_ocm_seconds_total", "vllm:spec_decode_num_drafts_total", "csd_spec_decode_num_bonus_tokens_total",
    ):  # fmt: skip
        assert name in after.names(), name
    # every series names the model, as vLLM's do (its dashboards select on it)
    unlabelled = {
        sample.name
        for sample in after.samples
        if "model_name" not in sample.labels and sample.name.startswith(("vllm:", "csd_"))
    }
    assert not unlabelled, sorted(unlabelled)
    assert {s.labels.get("model_name") for s in after.samples if "model_name" in s.labels} == {MODEL}


def test_probes_and_scrapes_are_not_counted_as_requests(api_server: Server) -> None:
    """The readiness polling at start (503s while the model loaded, then 200s) and every scrape so far
    left no trace in csd_requests_total: they are not traffic, as in vLLM."""
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{api_server.url}{path}", timeout=30).status_code == 200
    metrics = api_server.metrics()
    endpoints = {s.labels["endpoint"] for s in metrics.samples if s.name == "csd_requests_total"}
    assert not endpoints & {"/health", "/ready", "/metrics"}, endpoints


def test_batch_occupancy_is_served_as_kv_cache_usage(api_server: Server) -> None:
    """vllm:kv_cache_usage_perc is the fraction of batch rows in use (the endpoint picker reads it)."""
    idle = api_server.metrics()
    assert idle.value("vllm:num_requests_running") == 0 and idle.value("vllm:kv_cache_usage_perc") == 0
    # ignore_eos and the server's whole cap (--max-tokens-cap 512) keep the generation running while the
    # metrics are read, and a scrape that comes too late on a loaded machine is tried again
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 512, "stream": True, "ignore_eos": True}
    body["speculative"] = {"method": "vanilla"}
    for _ in range(5):
        with api_server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
            # the iterator is held: a generator dropped after `break` is finalised, which closes the
            # connection, and a fast server then stops the request before the scrape below answers
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break
            during = api_server.metrics()  # (leaving the block disconnects: the server stops the request)
        if during.value("vllm:num_requests_running") == 1:
            break
        assert wait_until(lambda: api_server.metrics().value("vllm:num_requests_running") == 0, timeout=20)
    assert during.value("vllm:num_requests_running") == 1
    assert during.value("vllm:kv_cache_usage_perc") == 1 / 16  # one of the default max_batch_size rows
    assert wait_until(lambda: api_server.metrics().value("vllm:kv_cache_usage_perc") == 0, timeout=20)
    # the picker's LoRA scorer reads this; no adapters are served
    (lora,) = [s for s in during.samples if s.name == "vllm:lora_requests_info"]
    assert lora.labels == {
        "model_name": MODEL, "max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""
    }  # fmt: skip


VANILLA = {"method": "vanilla", "drafter": "none"}  # one token per round: rounds are easy to count


def test_metrics_move_during_a_generation(api_server: Server) -> None:
    before = api_server.metrics()
    body = {
        "model": MODEL,
        "prompt": COUNTING,
        "max_tokens": 512,  # long enough to be running when the metrics answer, on a fast forward too
        "ignore_eos": True,
        "stream": True,
        "speculative": {"method": "vanilla"},
    }
    with api_server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 3:
                break
        during = api_server.metrics()
    # Leaving the block hangs up, which stops the generation (tested below).
    assert during.value("vllm:num_requests_running") == 1
    for name in (
        "csd_target_forwards_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert during.value(name, **VANILLA) > before.value(name, **VANILLA), name
    e2e = "vllm:e2e_request_latency_seconds_count"
    assert during.value(e2e, **VANILLA) == before.value(e2e, **VANILLA)  # not finished, yet counted


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-38},
        {"temperature": 5e-324},
        {"temperature": 0.8, "top_p": 1e-300},
        {"temperature": 2, "top_p": 5e-324},
    ],
)
def test_vanishing_sampling_parameters_decode(api_server: Server, sampling: dict) -> None:
    """Values the API accepts must decode (they gave 500 engine_error: nan probabilities)."""
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 4, "seed": 3, **sampling}
    with api_server.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_the_log_says_ready_with_the_address_and_every_line_has_a_timestamp(api_server: Server) -> None:
    """Issue 13, finding 10: one line to wait for, naming where the server answers; a timestamp on every
    log line (ours and uvicorn's, access log included). The CLI's own `csd: ...` line is a message."""
    log = api_server.log()
    assert f"ready: serving {MODEL} on {api_server.url} (" in log
    stamped = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR|DEBUG|CRITICAL)")
    lines = [line for line in log.splitlines() if line.strip() and not line.startswith("csd: ")]
    assert lines and all(stamped.match(line) for line in lines), [x for x in lines if not stamped.match(x)]


def test_max_generation_tokens_is_a_request_s_longest_choice(api_server: Server) -> None:
    """vLLM's `request_max_num_generation_tokens`: one observation per request, its longest of n choices
    (`request_generation_tokens` observes each choice)."""
    labels = {"method": "csd", "drafter": "combined"}
    before = api_server.metrics()
    with api_server.client() as http:
        body = {"model": MODEL, "prompt": "Name a colour:", "max_tokens": 10, "n": 3, "temperature": 1.0}
        data = http.post("/v1/completions", json={**body, "seed": 7, "logprobs": 0}).json()
    after = api_server.metrics()
    lengths = [len(choice["logprobs"]["tokens"]) for choice in data["choices"]]
    assert len(lengths) == 3 and sum(lengths) == data["usage"]["completion_tokens"]

    def delta(name: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert delta("vllm:request_max_num_generation_tokens_count") == 1
    assert delta("vllm:request_max_num_generation_tokens_sum") == max(lengths)
    assert delta("vllm:request_generation_tokens_count") == 3
    assert delta("vllm:request_generation_tokens_sum") == sum(lengths)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(api_server: Server, path: str) -> None:
    """vLLM's `stream_options.continuous_usage_stats`: with include_usage, every chunk carries the usage so
    far; the last chunk's usage is the request's. Without include_usage it asks for nothing (vLLM's rule)."""
    prompt = (
        {"messages": [{"role": "user", "content": "Count from 1 to 20."}]}
        if "chat" in path
        else {"prompt": COUNTING}
    )
    body = {"model": MODEL, **prompt, "max_tokens": 10, "stream": True, "ignore_eos": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    with api_server.client() as http:
        raw = http.post(path, json={**body, "stream_options": options}).content
        alone = http.post(path, json={**body, "stream_options": {"continuous_usage_stats": True}}).content
    chunks = [json.loads(p) for p in sse_events(raw)[:-1]]
    *streamed, usage_chunk = chunks
    final = usage_chunk["usage"]
    assert usage_chunk["choices"] == [] and final["completion_tokens"] == 10
    counts = [c["usage"]["completion_tokens"] for c in streamed]
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in streamed)
    assert all(
        c["usage"]["total_tokens"] == final["prompt_tokens"] + c["usage"]["completion_tokens"]
        for c in streamed
    )
    assert counts == sorted(counts) and counts[-1] == 10  # it grows with the text, to the whole count
    assert len(set(counts)) > 2  # really updated along the way, not only at the end
    assert all("usage" not in json.loads(p) for p in sse_events(alone)[:-1])
