"""The shared OCM in Redis, against a real redis-server (AOF on) started per test on a free port."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from bench.redis_process import RedisProcess
from ocm_store import Namespace, StoreUnavailableError, keys
from ocm_store.redis_store import RedisStore
from tests.ocm_store import helpers
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


def in_redis(client: redis.Redis, ns: Namespace = NS) -> dict[tuple[int, int], int]:
    return helpers.in_redis(client, ns)


def record_patterns(memory) -> None:
    for pattern, times in PATTERNS:
        for _ in range(times):
            memory.record([pattern])


@pytest.fixture
def stores():
    """Opens RedisStores with test-friendly intervals and closes them at the end."""
    opened: list[RedisStore] = []

    def open_(url: str, **kwargs) -> RedisStore:
        kwargs.setdefault("flush_interval_s", 0.05)
        kwargs.setdefault("refresh_interval_s", 0.2)
        kwargs.setdefault("max_backoff_s", 0.2)
        store = RedisStore(url, **kwargs)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


# ---------------------------------------------------------------- pooling and persistence


def test_two_replica_processes_pool_patterns_within_the_refresh_interval(redis_server, stores):
    flush_s, refresh_s = 0.1, 0.2
    b = stores(redis_server.url, flush_interval_s=flush_s, refresh_interval_s=refresh_s)
    mem_b = b.memory(NS)
    assert mem_b.counts(PAIRS) == [0] * len(PAIRS)

    a = replica("--redis-url", redis_server.url, "--refresh-interval", str(refresh_s), "record-hold",
                stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert a.stdout.readline().strip() == "recorded"
        took = wait_until(lambda: mem_b.counts(PAIRS) == EXPECTED, timeout=10)
        # A is still running: B got the patterns through A's background flush and its own refresh, not
        # through a flush at A's shutdown; and within about a second, as the issue asks.
        assert a.poll() is None
        assert took < flush_s + refresh_s + 1.0, f"replica B saw A's patterns only after {took:.2f}s"
    finally:
        a.stdin.close()
        a.wait(timeout=30)
    assert a.returncode == 0


def test_counts_survive_a_restart_of_the_store_process(redis_server, redis_client):
    writer = replica("--redis-url", redis_server.url, "record-exit")
    assert writer.wait(timeout=60) == 0
    reader = replica("--redis-url", redis_server.url, "read")
    out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0
    result = json.loads(out)
    assert result["counts"] == EXPECTED
    assert result["status"]["healthy"] is True
    assert in_redis(redis_client) == dict(PATTERNS)


def test_counts_survive_a_redis_crash_and_restart(redis_server, stores):
    store = stores(redis_server.url)
    memory = store.memory(NS)
    record_patterns(memory)
    assert store.flush()

    redis_server.kill()  # SIGKILL: what survives is what the AOF had
    redis_server.start()

    assert stores(redis_server.url).memory(NS).counts(PAIRS) == EXPECTED
    # The first store goes on counting on a new connection (whether or not it noticed the short outage).
    memory.record([PAIRS[0]])
    wait_until(store.flush, timeout=15, step=0.1)
    assert stores(redis_server.url).memory(NS).counts(PAIRS[:1]) == [EXPECTED[0] + 1]


def test_no_double_counting_after_flushes_and_refreshes(redis_server, stores):
    store = stores(redis_server.url)
    memory = store.memory(NS)
    pattern = (7, 8)
    for _ in range(5):
        memory.record([pattern])
    assert memory.counts([pattern]) == [5]  # buffered, not yet in Redis
    assert store.flush()
    assert memory.counts([pattern]) == [5]  # flushed: now in the snapshot, no longer in the buffer
    refreshes = 3
    time.sleep(refreshes * store.refresh_interval_s)
    assert memory.counts([pattern]) == [5]
    memory.record([pattern])
    assert memory.counts([pattern]) == [6]


def test_refresh_is_incremental_and_reloads_everything_when_the_log_cannot_tell(
    redis_server, redis_client, stores
):
    a = stores(redis_server.url)
    b = stores(redis_server.url, refresh_interval_s=3600)  # refreshed by hand below
    mem_a, mem_b = a.memory(NS), b.memory(NS)
    mem_a.record([(1, 1), (2, 2)])
    assert a.flush() and b.refresh()
    assert mem_b.counts([(1, 1), (2, 2)]) == [1, 1]

    # Written behind the store's back (no change stamp): an incremental refresh cannot see it ...
    k = keys.keys_for(NS)
    redis_client.zadd(k.counts, {"3:3": 5})
    mem_a.record([(1, 1)])
    assert a.flush() and b.refresh()
    assert mem_b.counts([(1, 1), (3, 3)]) == [2, 0]
    # ... until the log says it is incomplete (its floor is past what B has seen): then B reloads it all.
    redis_client.hset(k.meta, "floor", int(redis_client.hget(k.meta, "seq")) + 1)
    mem_a.record([(2, 2)])
    assert a.flush() and b.refresh()
    assert mem_b.counts([(1, 1), (2, 2), (3, 3)]) == [2, 2, 5]


# ---------------------------------------------------------------- concurrency and the hot path


def test_eight_threads_of_ten_thousand_increments_count_exactly(redis_server, redis_client, stores):
    store = stores(redis_server.url, flush_interval_s=0.01, flush_every=500)
    memory = store.memory(NS)
    threads_n, per_thread, spread = 8, 10_000, 64
    errors: list[BaseException] = []

    def hammer(i: int) -> None:
        try:
            for j in range(per_thread):
                pattern = (j % spread, i)
                memory.record([pattern])  # what the verification does at a rejection ...
                memory.counts([pattern])  # ... and right after
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.flush()

    expected = Counter({(j % spread, i): 0 for i in range(threads_n) for j in range(spread)})
    for i in range(threads_n):
        for j in range(per_thread):
            expected[(j % spread, i)] += 1
    assert sum(expected.values()) == threads_n * per_thread
    assert in_redis(redis_client) == dict(expected)
    assert memory.counts(list(expected)) == list(expected.values())
    assert stores(redis_server.url).memory(NS).counts(list(expected)) == list(expected.values())
    extra = store.status().extra
    assert extra["dropped_increments"] == 0 and extra["buffered_increments"] == 0
    assert extra["flushes"] > 1  # flushed in the background while the threads ran, not only at the end


def test_the_hot_path_never_waits_on_a_hung_redis(redis_server, redis_client, stores):
    store = stores(redis_server.url, flush_interval_s=0.01, command_timeout_s=3.0)
    memory = store.memory(NS)
    memory.record([(1, 2)])
    assert store.flush()
    redis_server.freeze()  # sockets stay open, nothing answers: every network call would hang 3 s
    try:
        time.sleep(0.2)  # the worker is now stuck in a flush
        flushes = store.status().extra["flushes"]
        started = time.monotonic()
        for _ in range(1000):
            memory.record([(1, 2)])
            memory.counts([(1, 2)])
        elapsed = time.monotonic() - started
        assert store.status().extra["flushes"] == flushes  # the worker was indeed blocked meanwhile
    finally:
        redis_server.thaw()
    assert elapsed < 1.0, f"1000 record/counts calls took {elapsed:.2f}s while Redis hung"
    assert memory.counts([(1, 2)]) == [1001]
    wait_until(lambda: store.flush(), timeout=15, step=0.1)
    assert in_redis(redis_client) == {(1, 2): 1001}


# ---------------------------------------------------------------- bounded memory


def test_the_cap_drops_the_rarest_patterns_in_redis_and_in_every_replica(redis_server, redis_client, stores):
    cap = 100
    store = stores(redis_server.url, max_patterns=cap)
    other = stores(redis_server.url, max_patterns=cap)
    other_memory = other.memory(NS)
    memory = store.memory(NS)
    frequent = [(i, 0) for i in range(20)]  # seen 10 times
    middling = [(500 + i, 1) for i in range(30)]  # seen twice
    rare = [(2000 + i, 1) for i in range(100)]  # seen once
    for _ in range(10):
        memory.record(frequent)
    for _ in range(2):
        memory.record(middling)
    assert store.flush()
    assert store.status().extra["evicted"] == 0
    memory.record(rare)
    assert store.flush()  # 150 patterns > cap: back down to 90 % of it

    held = in_redis(redis_client)
    keep = int(cap * 0.9)
    assert len(held) == keep
    assert all(held[p] == 10 for p in frequent) and all(held[p] == 2 for p in middling)
    assert sum(p in held for p in rare) == keep - len(frequent) - len(middling)  # only rare ones went
    assert store.status().extra["evicted"] == len(frequent) + len(middling) + len(rare) - keep
    # Both replicas reload the capped set (the eviction bumped the epoch): their views match Redis.
    everything = frequent + middling + rare
    wait_until(lambda: other_memory.counts(everything) == [held.get(p, 0) for p in everything], timeout=10)
    wait_until(lambda: memory.counts(everything) == [held.get(p, 0) for p in everything], timeout=10)
    assert store.status().patterns == keep
    top = other.top(NS, 25)
    assert [p.count for p in top] == [10] * 20 + [2] * 5
    assert {(p.draft_token, p.target_token) for p in top[:20]} == set(frequent)


def test_unreachable_at_start_works_local_only_bounds_the_buffer_and_flushes_on_reconnect(tmp_path, stores):
    server = RedisProcess(tmp_path / "redis")  # port chosen, nothing listening yet
    store = stores(server.url, max_buffered=10)
    status = store.status()
    assert not store.reachable() and not status.healthy
    assert "unreachable" in status.detail and "local-only" in status.detail

    memory = store.memory(NS)
    for i in range(15):  # 15 distinct patterns, i + 1 increments each; the buffer holds 10 patterns
        for _ in range(i + 1):
            memory.record([(i, 0)])
    for _ in range(100):  # more increments of a pattern already buffered always fit
        memory.record([(0, 0)])
    expected = {(i, 0): i + 1 for i in range(10)}
    expected[(0, 0)] += 100
    assert memory.counts(list(expected)) == list(expected.values())  # decoding uses what it learned
    extra = store.status().extra
    assert extra["buffered_increments"] == sum(expected.values())
    assert extra["dropped_increments"] == sum(i + 1 for i in range(10, 15))  # counted, never silent

    server.start()
    try:
        wait_until(lambda: store.status().extra["buffered_increments"] == 0, timeout=15)
        status = store.status()
        assert status.healthy and status.extra["reconnects"] == 1
        client = redis.Redis(port=server.port)
        assert in_redis(client) == expected
        client.close()
    finally:
        server.stop()


# ---------------------------------------------------------------- junk and faults


def test_junk_values_in_redis_are_skipped_logged_and_reported(redis_server, redis_client, stores, caplog):
    caplog.set_level(logging.WARNING)
    k = keys.keys_for(NS)
    redis_client.zadd(k.counts, {"1:2": 5, "3:4": 2.5, "hello": 7, "5:6": -3, "7:8": float("inf")})
    redis_client.hset(keys.REGISTRY, "0123456789abcdef", "not a namespace key")
    store = stores(redis_server.url)
    memory = store.memory(NS)

    assert memory.counts([(1, 2), (3, 4), (5, 6), (7, 8)]) == [5, 0, 0, 0]  # junk reads as unseen
    status = store.status()
    assert not status.healthy and "4 malformed values" in status.detail
    assert status.extra["malformed_values"] == 4
    assert "skipped 4 malformed values" in caplog.text and "3:4" in caplog.text
    assert store.namespaces() == [NS]  # the junk registry entry is skipped
    assert "registry entry" in caplog.text
    assert [(p.draft_token, p.count) for p in store.top(NS, 5)] == [(1, 5)]  # inf, 7 'hello' skipped

    # The next increment of a junk pattern replaces the junk (junk counts as 0).
    memory.record([(3, 4)])
    assert store.flush()
    assert redis_client.zscore(k.counts, "3:4") == 1
    assert memory.counts([(3, 4)]) == [1]
    assert store.status().extra["malformed_values"] == 3


def test_a_key_of_the_wrong_type_degrades_that_namespace_only(redis_server, redis_client, stores, caplog):
    spoiled = Namespace("other-target@rev", "ngram", "vocab")
    redis_client.set(keys.keys_for(spoiled).counts, "not a hash")
    store = stores(redis_server.url)
    good, bad = store.memory(NS), store.memory(spoiled)

    bad.record([(1, 1)])
    good.record([(2, 2)])
    assert not store.flush()  # the spoiled namespace's increment stays buffered
    assert bad.counts([(1, 1)]) == [1]  # decoding goes on
    status = store.status()
    assert not status.healthy and spoiled.key in status.detail and "holds a string" in status.detail
    assert in_redis(redis_client) == {(2, 2): 1}
    assert redis_client.get(keys.keys_for(spoiled).counts) == b"not a hash"  # never overwritten
    assert "refused namespace" in caplog.text


SECRET = "wrong-staple-9f3c"


def test_a_wrong_password_degrades_and_the_password_is_never_shown(tmp_path, stores, caplog):
    caplog.set_level(logging.DEBUG)
    with RedisProcess(tmp_path / "redis", password="right-horse-battery") as server:
        for url in (
            f"redis://:{SECRET}@127.0.0.1:{server.port}/0",
            f"redis://alice:{SECRET}@127.0.0.1:{server.port}/0",
        ):
            store = stores(url)
            memory = store.memory(NS)
            memory.record([(1, 2)])
            assert memory.counts([(1, 2)]) == [1]  # decoding goes on, local-only
            status = store.status()
            assert not status.healthy
            assert "unreachable" in status.detail and "AuthenticationError" in status.detail
            with pytest.raises(StoreUnavailableError) as raised:
                store.reset(NS)
            store.close()
            shown = [caplog.text, repr(status), str(raised.value), repr(raised.value), repr(store.__dict__)]
            for text in shown:
                assert SECRET not in text
            assert "***" in status.detail

        good = stores(server.url)  # the right password works
        good.memory(NS).record([(1, 2)])
        assert good.flush() and good.status().healthy


def test_an_acl_user_confined_to_the_prefix_can_do_everything(tmp_path, stores):
    """Nothing outside csd:ocm:v1:* is read or written: Redis itself refuses it to this user."""
    acl = ("--user", "ocm", "on", ">ocm-pw", f"~{keys.PREFIX}:*", "+@all")
    with RedisProcess(tmp_path / "redis", password="admin-pw", extra_args=acl) as server:
        admin = redis.Redis(port=server.port, password="admin-pw")
        admin.set("someone:else", "theirs")
        url = f"redis://ocm:ocm-pw@127.0.0.1:{server.port}/0"
        store = stores(url, max_patterns=100)
        memory = store.memory(NS)
        for i in range(150):  # past the cap: the eviction runs too
            memory.record([(i, 0)] * (1 + i % 3))
        assert store.flush()
        store.merge(NS, [(1, 0, 5)])
        assert len(store.top(NS, 1000)) <= 100 and store.namespaces() == [NS]
        time.sleep(3 * store.refresh_interval_s)
        status = store.status()
        assert status.healthy, status.detail
        store.reset(NS)
        store.reset()
        assert store.status().healthy
        with pytest.raises(redis.exceptions.NoPermissionError):  # the ACL does bite
            redis.Redis(port=server.port, username="ocm", password="ocm-pw").get("someone:else")
        assert admin.get("someone:else") == b"theirs"
        admin.close()


def test_tls_with_rediss_urls(tmp_path, stores):
    certs = make_certificates(tmp_path / "tls")
    tls = {"cert": str(certs / "server.crt"), "key": str(certs / "server.key"), "ca": str(certs / "ca.crt")}
    with RedisProcess(tmp_path / "redis", password="tls-pw", tls=tls) as server:
        url = f"rediss://:tls-pw@localhost:{server.port}/0?ssl_ca_certs={certs / 'ca.crt'}"
        store = stores(url)
        memory = store.memory(NS)
        memory.record([(4, 2)])
        assert store.flush() and store.status().healthy
        assert stores(url).memory(NS).counts([(4, 2)]) == [1]
        plain = stores(f"redis://:tls-pw@localhost:{server.port}/0")  # no TLS against a TLS port
        assert not plain.status().healthy


def make_certificates(directory: Path) -> Path:
    """A throwaway CA and a server certificate for localhost / 127.0.0.1, made with the openssl tool."""
    directory.mkdir(parents=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "1", "-subj", "/CN=csd-test-ca")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=localhost")  # fmt: skip
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    return directory


def test_both_backends_report_the_same_status_keys(redis_server, stores):
    from ocm_store import InMemoryStore

    required = {"buffered_increments", "dropped_increments", "flushes", "flush_seconds_total",
                "last_flush_seconds", "evicted", "reconnects"}  # fmt: skip
    shared, embedded = stores(redis_server.url).status(), InMemoryStore().status()
    assert required <= set(shared.extra) and set(shared.extra) == set(embedded.extra)
    for status in (shared, embedded):
        assert all(isinstance(v, int | float) for v in status.extra.values())
