"""The suffix drafter through real HTTP on the shared server (two API keys): a key's earlier outputs shape its
own later drafts, never another key's (service/api/tenants.py: one tenant per key by default)."""

from __future__ import annotations

from tests.api.conftest import API_KEYS, Server, suffix_chat


def test_a_keys_outputs_draft_for_that_key_only(api_server: Server):
    first = suffix_chat(api_server.url, API_KEYS[0])
    again = suffix_chat(api_server.url, API_KEYS[0])  # the same tenant: its first answer is in its pool now
    other = suffix_chat(
        api_server.url, API_KEYS[1]
    )  # another tenant: it must draft as if the first never ran
    assert first["drafter"] == "suffix"
    assert first["text"] == again["text"] == other["text"]  # strict: the drafts change the speed only
    # the repeat drafts the whole earlier answer: most of its tokens accepted, in a few forwards
    assert again["accepted_tokens"] > first["accepted_tokens"] + 20, (first, again)
    assert again["target_forwards"] < first["target_forwards"] / 2, (first, again)
    # the other tenant gets none of it: no more accepted than the first run's own text gave
    assert other["accepted_tokens"] <= first["accepted_tokens"] + 2, (first, other)
    assert other["target_forwards"] >= first["target_forwards"] - 2, (first, other)
