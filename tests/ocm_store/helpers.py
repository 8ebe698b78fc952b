"""Helpers shared by the OCM store tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from ocm_store import Namespace, keys


def wait_until(condition: Callable[[], object], timeout: float, step: float = 0.01) -> float:
    """Poll until `condition()` is true; returns the seconds it took. Fails the test on timeout."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(step)
    return time.monotonic() - started


def in_redis(client: redis.Redis, namespace: Namespace) -> dict[tuple[int, int], int]:
    """The counts the store wrote for a namespace, read straight from Redis."""
    held = client.zrange(keys.keys_for(namespace).counts, 0, -1, withscores=True)
    return {keys.parse_field(member): int(score) for member, score in held}
