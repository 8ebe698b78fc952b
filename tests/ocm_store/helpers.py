"""Helpers shared by the OCM store tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_until(condition: Callable[[], object], timeout: float, step: float = 0.01) -> float:
    """Poll until `condition()` is true; returns the seconds it took. Fails the test on timeout."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(step)
    return time.monotonic() - started
