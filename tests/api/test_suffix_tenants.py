"""The suffix drafter through real HTTP on the shared server (two API keys): a key's earlier outputs shape its
own later drafts, never another key's (service/api/tenants.py: one tenant per key by default)."""

from __future__ import annotations

import httpx

from tests.api.conftest import API_KEYS, Server

PROMPT = "Explain in two sentences why the sky is blue."  # an answer that does not repeat itself


def _chat(server: Server, key: str) -> dict:
    """A greedy strict-SD chat completion with the suffix drafter, as `key`: (its text, its statistics)."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 48,
                "temperature": 0,
                "speculative": {"method": "sd", "drafter": "suffix", "num_speculative_tokens": 16},
            },
        )
    assert response.status_code == 200, response.text
    body = response.json()
    return {"text": body["choices"][0]["message"]["content"], **body["speculative"]}


def test_a_keys_outputs_draft_for_that_key_only(api_server: Server):
    first = _chat(api_server, API_KEYS[0])
    again = _chat(api_server, API_KEYS[0])  # the same tenant: its first answer is in its pool now
    other = _chat(api_server, API_KEYS[1])  # another tenant: it must draft as if the first never ran
    assert first["drafter"] == "suffix"
    assert first["text"] == again["text"] == other["text"]  # strict: the drafts change the speed only
    # the repeat drafts the whole earlier answer: most of its tokens accepted, in a few forwards
    assert again["accepted_tokens"] > first["accepted_tokens"] + 20, (first, again)
    assert again["target_forwards"] < first["target_forwards"] / 2, (first, again)
    # the other tenant gets none of it: no more accepted than the first run's own text gave
    assert other["accepted_tokens"] <= first["accepted_tokens"] + 2, (first, other)
    assert other["target_forwards"] >= first["target_forwards"] - 2, (first, other)
