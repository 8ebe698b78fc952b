"""The `slow` split behind `make test-fast` means something: `-m "not slow"` leaves out the tests
tests/slow_tests.py lists, keeps unit and API tests of every layer, and every listed key still names a test.
One collection in a subprocess (no test runs): about 10 s."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.slow_tests import SLOW, slow_key

REPO = Path(__file__).resolve().parents[1]


def _collect(*args: str) -> tuple[list[str], int, int]:
    """(the node ids collected, how many selected, how many in all) of `pytest --collect-only -q *args`."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    summary = re.search(r"^(\d+)/(\d+) tests collected \((\d+) deselected\)", done.stdout, re.M)
    assert summary, done.stdout[-1000:]
    selected, total, deselected = map(int, summary.groups())
    assert selected == len(ids) and selected + deselected == total
    return ids, selected, total


def test_not_slow_is_a_real_subset_of_every_layer():
    fast, selected, total = _collect("-m", "not slow")
    assert 0 < selected < total
    assert not [i for i in fast if slow_key(i)], "a listed test was not deselected"
    # unit and API tests of every layer stay in the fast run
    for folder in (
        "tests/api/",
        "tests/decoding/",
        "tests/executor/",
        "tests/service/",
        "tests/ocm_store/",
        "tests/deploy/",
    ):
        assert sum(i.startswith(folder) for i in fast) >= 5, folder
    for core in (
        "tests/decoding/test_lossless.py::",
        "tests/decoding/test_verification.py::",
        "tests/test_layering",
    ):
        assert any(i.startswith(core) for i in fast), core
    assert not any(i.startswith("tests/playground/") for i in fast)


def _names_a_test(key: str) -> bool:
    """The key's folder or module exists, and so does its test function where it names one."""
    path, _, name = key.partition("::")
    if not (REPO / path.rstrip("/")).exists():
        return False
    function = re.escape(name.split("[")[0])
    return not name or re.search(rf"^def {function}\(", (REPO / path).read_text(), re.M) is not None


def test_every_key_names_a_test():
    """Without this, a renamed test would quietly join the fast run: each key must match a test on disk."""
    assert [key for key in SLOW if not _names_a_test(key)] == []
    assert not _names_a_test("tests/api/test_limits.py::test_that_was_renamed")  # the check can fail


def test_keys_match_by_whole_names():
    assert slow_key("tests/api/test_limits.py::test_x[a]") == "tests/api/test_limits.py"
    assert slow_key("tests/playground/test_cors.py::test_y") == "tests/playground/"
    assert slow_key("tests/api/test_limits_more.py::test_x") is None  # a module prefix is not a match
    assert slow_key("tests/test_cli.py::test_calibrate_then_ocm_top_shows_decoded_patterns_again") is None
    assert slow_key("tests/api/test_http.py::test_models") is None
