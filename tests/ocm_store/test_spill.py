"""Redis away at shutdown loses nothing (issue 13, finding 4): the buffered increments are spilled to the
local disk and the next start replays them, exactly once, even when one batch had reached Redis with its
reply lost, and even when a replay is repeated.

A real redis-server (free port, AOF on) that is frozen (SIGSTOP: sockets open, no answers) and thawed; real
stores. The one fake is the repeated replay: a copy of the spill file put back, as a crash between the
replay and the file's removal would leave it.
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter

from ocm_store import Namespace
from ocm_store.redis_store import RedisStore
from tests.ocm_store.helpers import in_redis, wait_until

NS = Namespace("spill-model@1", "ngram", "v1")
FIRST = [(1, 2)] * 3 + [(3, 4)]
SECOND = [(1, 2)] * 2 + [(5, 6)] * 4  # sent while Redis is frozen: applied later, its reply lost
THIRD = [(7, 8)] * 5 + [(3, 4)]  # recorded while Redis is away: never sent by the first store


def open_store(url: str, spill_dir, **kwargs) -> RedisStore:
    return RedisStore(
        url,
        spill_dir=spill_dir,
        flush_interval_s=0.05,
        refresh_interval_s=0.2,
        max_backoff_s=0.2,
        connect_timeout_s=0.5,
        command_timeout_s=0.5,
        **kwargs,
    )


def record(memory, patterns) -> None:
    for pattern in patterns:
        memory.record([pattern])


def test_increments_buffered_at_shutdown_are_spilled_and_replayed_once(
    redis_server, redis_client, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="ocm_store")
    spill = tmp_path / "spill"
    a = open_store(redis_server.url, spill)
    memory = a.memory(NS)
    record(memory, FIRST)
    assert a.flush() and in_redis(redis_client, NS) == Counter(FIRST)

    redis_server.freeze()
    try:
        record(memory, SECOND)
        wait_until(lambda: not a.reachable(), timeout=20)  # the flush of SECOND timed out in flight
        record(memory, THIRD)
        a.close()
    finally:
        redis_server.thaw()
    (spilled,) = spill.iterdir()
    assert "spilled to" in caplog.text and "are lost" not in caplog.text
    assert a.status().extra["dropped_increments"] == 0

    # The frozen server read SECOND's batch before it stopped answering: once thawed it applies it.
    wait_until(lambda: in_redis(redis_client, NS) == Counter(FIRST + SECOND), timeout=20)
    kept = tmp_path / "copy.json"
    shutil.copyfile(spilled, kept)

    b = open_store(redis_server.url, spill)
    wait_until(lambda: b.flush() and not spilled.exists(), timeout=20)
    expected = Counter(FIRST + SECOND + THIRD)
    assert in_redis(redis_client, NS) == expected  # SECOND skipped by its batch id, THIRD applied once
    assert b.memory(NS).counts(list(expected)) == list(expected.values())
    b.close()

    shutil.copyfile(kept, spilled)  # the fake crash: the file came back after its replay
    c = open_store(redis_server.url, spill)
    wait_until(lambda: c.flush() and not spilled.exists(), timeout=20)
    assert in_redis(redis_client, NS) == expected
    c.close()
    assert list(spill.iterdir()) == []


def test_a_spill_survives_a_start_while_redis_is_still_away(redis_server, redis_client, tmp_path):
    """The next start finds Redis away too: it serves the spilled counts locally and spills them again
    at its own shutdown, beside its own increments; the start after that sends everything once."""
    spill = tmp_path / "spill"
    redis_server.stop()
    a = open_store(redis_server.url, spill)
    record(a.memory(NS), FIRST)
    a.close()
    b = open_store(redis_server.url, spill)
    memory = b.memory(NS)
    assert memory.counts([(1, 2)]) == [3]  # the spilled counts are in the local view
    record(memory, THIRD)
    b.close()
    assert len(list(spill.iterdir())) == 1  # b's file holds a's batches too

    redis_server.start()
    c = open_store(redis_server.url, spill)
    wait_until(lambda: c.flush() and not list(spill.iterdir()), timeout=20)
    assert in_redis(redis_client, NS) == Counter(FIRST + THIRD)
    c.close()


def test_an_unreadable_spill_file_is_set_aside_not_replayed(redis_server, redis_client, tmp_path, caplog):
    spill = tmp_path / "spill"
    spill.mkdir()
    (spill / "ocm-spill-deadbeef.json").write_text("{not json")
    store = open_store(redis_server.url, spill)
    assert store.flush()
    store.close()
    assert [p.name for p in spill.iterdir()] == ["ocm-spill-deadbeef.bad"]
    assert "cannot read the spill file" in caplog.text
    assert in_redis(redis_client, NS) == {}
