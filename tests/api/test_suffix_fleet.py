"""Suffix drafts pooled across a fleet of two real `csd serve` processes and a real redis-server: what replica A
served drafts for a replica B started later (it reads the stream back), for the same API key only; with Redis
gone, B still serves the suffix drafter from what it has."""

from __future__ import annotations

import pytest
import redis

from bench.redis_process import RedisProcess
from ocm_store.draft_pool import PREFIX
from tests.api.conftest import start_server, suffix_chat

KEYS = ("sk-fleet-tenant-one", "sk-fleet-tenant-two")


@pytest.fixture
def redis_server(tmp_path):
    server = RedisProcess(tmp_path / "redis").start()
    yield server
    server.stop()


def test_a_replica_started_later_drafts_what_another_served_for_the_same_key(tmp_path, redis_server):
    flags = ("--redis-url", redis_server.url, *[a for key in KEYS for a in ("--api-key", key)])
    first = start_server(tmp_path / "a", *flags, api_key=KEYS[0])
    try:
        cold = suffix_chat(first.url, KEYS[0])
        direct = redis.Redis(port=redis_server.port)
        (stream,) = direct.keys(f"{PREFIX}:*")
        assert direct.xlen(stream) == 1
    finally:
        first.stop()
    second = start_server(tmp_path / "b", *flags, api_key=KEYS[0])
    try:
        other = suffix_chat(second.url, KEYS[1])  # another tenant first: A's answer must not draft for it
        pooled = suffix_chat(second.url, KEYS[0])
        assert cold["text"] == pooled["text"] == other["text"]
        assert pooled["accepted_tokens"] > cold["accepted_tokens"] + 20, (cold, pooled)
        assert pooled["target_forwards"] < cold["target_forwards"] / 2, (cold, pooled)
        assert other["accepted_tokens"] <= cold["accepted_tokens"] + 2, (cold, other)
        redis_server.stop()  # Redis gone: the replica serves on, drafting from what it holds
        after = suffix_chat(second.url, KEYS[0])
        assert after["text"] == cold["text"]
        assert after["accepted_tokens"] > cold["accepted_tokens"] + 20, (cold, after)
    finally:
        second.stop()
