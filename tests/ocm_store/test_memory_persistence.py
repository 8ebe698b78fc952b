"""The embedded (in-process) store's SQLite persistence: counts survive a restart, bad files degrade."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from ocm_store import InMemoryStore, Namespace
from tests.ocm_store.helpers import wait_until
from tests.ocm_store.replica import NAMESPACE as NS
from tests.ocm_store.replica import PATTERNS

ROOT = Path(__file__).resolve().parents[2]
REPLICA = Path(__file__).with_name("replica.py")
PAIRS = [p for p, _ in PATTERNS]
EXPECTED = [n for _, n in PATTERNS]


def replica(*args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(REPLICA), *args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, **popen
    )


def read_back(path: Path) -> dict:
    reader = replica("--path", str(path), "read")
    out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0
    return json.loads(out)


def test_counts_survive_a_restart_of_the_store_process(tmp_path):
    path = tmp_path / "ocm.sqlite"
    writer = replica("--path", str(path), "record-exit")  # saved on close
    assert writer.wait(timeout=60) == 0
    result = read_back(path)
    assert result["counts"] == EXPECTED
    assert result["status"]["healthy"] is True


def test_the_scheduled_save_survives_a_crash(tmp_path):
    path = tmp_path / "ocm.sqlite"
    writer = replica("--path", str(path), "--save-interval", "0.1", "record-hold", stdin=subprocess.PIPE)
    try:
        assert writer.stdout.readline().strip() == "recorded"

        def saved() -> bool:
            try:
                with sqlite3.connect(path) as conn:
                    return conn.execute("SELECT SUM(count) FROM patterns").fetchone()[0] == sum(EXPECTED)
            except sqlite3.Error:
                return False

        wait_until(saved, timeout=30, step=0.05)
        os.kill(writer.pid, signal.SIGKILL)  # no close(), no save on shutdown
        writer.wait(timeout=30)
    finally:
        writer.stdin.close()
        if writer.poll() is None:
            writer.kill()
    assert read_back(path)["counts"] == EXPECTED


def test_a_corrupt_file_degrades_the_store_and_is_kept_aside(tmp_path):
    path = tmp_path / "ocm.sqlite"
    junk = b"this is not an SQLite database" * 100
    path.write_bytes(junk)
    store = InMemoryStore(path=path)
    status = store.status()
    assert not status.healthy and "cannot read" in status.detail and ".corrupt" in status.detail
    memory = store.memory(NS)
    assert memory.counts(PAIRS[:1]) == [0]
    memory.record([PAIRS[0]])  # decoding goes on, and what it learns is saved to a fresh file
    store.close()
    assert (tmp_path / "ocm.sqlite.corrupt").read_bytes() == junk
    again = InMemoryStore(path=path)
    assert again.memory(NS).counts(PAIRS[:1]) == [1]
    assert again.status().healthy
    again.close()


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "ocm.sqlite"
    good = Namespace("t@r", "ngram", "v")
    first = InMemoryStore(path=path)
    first.record(good, [(9, 9)])
    first.close()  # saves: the file and its table exist
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO patterns VALUES (?, ?, ?, ?)",
            [(good.key, 1, 2, 5), (good.key, 3, 4, "banana"), (good.key, 5, 6, -1), ("no-pipes", 7, 8, 9)],
        )
    store = InMemoryStore(path=path)
    assert store.memory(good).counts([(9, 9), (1, 2), (3, 4), (5, 6)]) == [1, 5, 0, 0]
    status = store.status()
    assert not status.healthy and "3 malformed rows" in status.detail
    assert status.extra["malformed_values"] == 3
    store.close()


def test_a_locked_file_is_neither_moved_nor_overwritten_and_is_loaded_once_free(tmp_path):
    path = tmp_path / "ocm.sqlite"
    first = InMemoryStore(path=path)
    first.record(NS, [PAIRS[0]])
    first.close()
    holder = sqlite3.connect(path)
    holder.execute("BEGIN EXCLUSIVE")  # another process in the middle of a long write
    store = InMemoryStore(path=path, busy_timeout_s=0.1)
    try:
        status = store.status()
        assert not status.healthy and "locked" in status.detail
        store.record(NS, [PAIRS[1]])  # decoding goes on meanwhile
        store.save()  # must not replace the file's counts by what this process alone has seen
        assert not (tmp_path / "ocm.sqlite.corrupt").exists()
    finally:
        holder.rollback()
        holder.close()
    store.save()  # the lock is gone: load, add, save
    assert store.status().healthy
    store.close()
    again = InMemoryStore(path=path)
    assert again.memory(NS).counts(PAIRS[:2]) == [1, 1]
    again.close()
