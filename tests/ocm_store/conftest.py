"""Fixtures for the OCM store tests: a throwaway redis-server per test (free port, tmp dir, AOF on)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from bench.redis_process import RedisProcess


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server) -> Iterator[redis.Redis]:
    """A direct client to inspect (or spoil) what the store wrote."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, password=redis_server.password)
    yield client
    client.close()
