"""`csd ocm stats|top|export|import|reset` against a real redis-server, and against the embedded store.

The round trip runs the real command (`python -m service.cli`) in subprocesses, as a user would; each one
imports torch (through service.config), so the checks are chained in few calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.redis_process import RedisProcess
from service.cli import main

ROOT = Path(__file__).resolve().parents[2]
NS_A = "target-a@rev|ngram|vocab-a"
NS_B = "target-b@rev|ngram|vocab-b"
ROWS = [
    {"namespace": NS_A, "draft_token": 10, "target_token": 11, "count": 9},
    {"namespace": NS_A, "draft_token": 12, "target_token": 13, "count": 4},
    {"namespace": NS_A, "draft_token": 14, "target_token": 15, "count": 1},
    {"namespace": NS_B, "draft_token": 20, "target_token": 21, "count": 7},
    {"namespace": NS_B, "draft_token": 22, "target_token": 23, "count": 2},
]
SECRET = "cli-secret-5d1e"
PASSWORD = "right-pw-77c2"


def csd(*args: str, tmp_path: Path, wait: bool = True):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CSD_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("CSD_REDIS_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    if not wait:
        return process
    out, err = process.communicate(timeout=300)
    return process.returncode, out, err


def rows_of(path: Path) -> list[dict]:
    return sorted(
        (json.loads(line) for line in path.read_text().splitlines() if line.strip()),
        key=lambda r: (r["namespace"], r["draft_token"]),
    )


@pytest.fixture
def protected_redis(tmp_path):
    with RedisProcess(tmp_path / "redis", password=PASSWORD) as server:
        yield server


def test_ocm_tools_round_trip_through_redis(protected_redis, tmp_path):
    url = protected_redis.url
    assert PASSWORD in url
    # Started first, runs alongside the round trip: a wrong password is one clear line, exit 2, no secret.
    wrong = csd("ocm", "export", str(tmp_path / "never.jsonl"), "--redis-url",
                f"redis://:{SECRET}@127.0.0.1:{protected_redis.port}/0", tmp_path=tmp_path, wait=False)  # fmt: skip
    outputs = []

    seed = tmp_path / "seed.jsonl"
    seed.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    rc, out, err = csd("ocm", "import", str(seed), "--redis-url", url, tmp_path=tmp_path)
    outputs += [out, err]
    assert rc == 0, err
    assert "imported 5 patterns into 2 namespaces" in out

    rc, out, err = csd("ocm", "top", "-n", "2", "--raw", "--namespace", "target-a", "--redis-url", url,
                       tmp_path=tmp_path)  # fmt: skip
    outputs += [out, err]
    assert rc == 0, err
    assert out.split("\n")[:3] == [f"# {NS_A}", "       9  10 -> 11", "       4  12 -> 13"]

    exported = tmp_path / "export.jsonl"
    rc, out, err = csd("ocm", "export", str(exported), "--redis-url", url, tmp_path=tmp_path)
    assert rc == 0, err
    assert rows_of(exported) == rows_of(seed)

    rc, out, err = csd("ocm", "reset", "--namespace", "target-a", "--redis-url", url, tmp_path=tmp_path)
    assert rc == 0, err
    rc, out, err = csd("ocm", "stats", "--redis-url", url, tmp_path=tmp_path)
    outputs += [out, err]
    assert rc == 0, err
    stats = json.loads(out)
    assert stats["backend"] == "redis" and stats["healthy"] is True
    assert stats["namespaces"] == {NS_B: 2} and stats["patterns"] == 2
    assert stats["detail"].startswith("redis://:***@127.0.0.1")
    assert not any(PASSWORD in text for text in outputs)
    for key in ("buffered_increments", "dropped_increments", "flushes", "flush_seconds_total",
                "last_flush_seconds", "evicted", "reconnects"):  # fmt: skip
        assert key in stats

    out, err = wrong.communicate(timeout=300)
    assert wrong.returncode == 2
    assert err.strip().count("\n") == 0 and err.startswith("csd: error: the OCM store is unavailable")
    assert "AuthenticationError" in err
    assert SECRET not in out + err
    assert not (tmp_path / "never.jsonl").exists()


def test_ocm_tools_work_on_the_embedded_store(tmp_path, capsys):
    path = tmp_path / "ocm.sqlite"
    seed = tmp_path / "seed.jsonl"
    seed.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["ocm", "import", str(seed), "--ocm-path", str(path)]) == 0
    exported = tmp_path / "export.jsonl"
    assert main(["ocm", "export", str(exported), "--ocm-path", str(path)]) == 0
    assert rows_of(exported) == rows_of(seed)
    capsys.readouterr()
    assert main(["ocm", "stats", "--ocm-path", str(path)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["backend"] == "memory" and stats["patterns"] == 5
    assert main(["ocm", "reset", "--ocm-path", str(path)]) == 0
    assert main(["ocm", "stats", "--ocm-path", str(path)]) == 0
    assert json.loads(capsys.readouterr().out.split("reset all patterns\n")[-1])["namespaces"] == {}


def test_ocm_tools_reject_a_bad_url_in_one_line(tmp_path, capsys):
    assert main(["ocm", "stats", "--redis-url", f"http://user:{SECRET}@example"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("csd: error: invalid Redis URL") and err.count("\n") == 1
    assert SECRET not in err
