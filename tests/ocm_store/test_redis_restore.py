"""A Redis that loses the namespace's history (no persistence, restarted empty) under load: the replicas'
own views bring every count back, none counted twice; a deliberate reset still reaches every replica."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter

import redis

from bench.redis_process import RedisProcess
from ocm_store import Namespace
from ocm_store.redis_store import RedisStore
from tests.ocm_store.helpers import in_redis, wait_until

NS = Namespace("target@rev", "head", "vocab")
PATTERNS = [(i, 500 + i % 7) for i in range(300)]


def open_store(url: str) -> RedisStore:
    return RedisStore(url, flush_interval_s=0.02, refresh_interval_s=0.1, max_backoff_s=0.1, flush_every=64)


class Load:
    """Threads recording random patterns into each store, with a tally of every increment (the truth)."""

    def __init__(self, stores: list[RedisStore]) -> None:
        self.memories = [s.memory(NS) for s in stores]
        self.recorded: Counter[tuple[int, int]] = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(m, i)) for i, m in enumerate(self.memories)]

    def _run(self, memory, seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not self.stop.is_set():
                batch = [rng.choice(PATTERNS) for _ in range(rng.randint(1, 4))]
                memory.counts(batch)
                memory.record(batch)
                with self.lock:
                    self.recorded.update(batch)
                time.sleep(0.001)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def total(self) -> int:
        with self.lock:
            return sum(self.recorded.values())

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def settled(stores: list[RedisStore], client: redis.Redis, truth: dict) -> bool:
    """Everything flushed, Redis holds the truth and every replica's view equals it."""
    if not all(s.flush() for s in stores) or in_redis(client, NS) != truth:
        return False
    for s in stores:
        s.refresh()
    pairs = list(truth)
    return all(s.memory(NS).counts(pairs) == [truth[p] for p in pairs] for s in stores)


def test_redis_restarted_empty_under_load_gets_every_count_back_from_two_replicas(tmp_path, caplog):
    server = RedisProcess(tmp_path / "redis", persistent=False).start()
    stores = [open_store(server.url), open_store(server.url)]
    client = redis.Redis(port=server.port)
    caplog.set_level(logging.WARNING, logger="ocm_store")
    try:
        with Load(stores) as load:
            wait_until(lambda: load.total() > 2000, timeout=60)
            before = in_redis(client, NS)
            assert sum(before.values()) > 1000
            server.kill()
            server.start()  # same port, no persistence: empty (the replicas refill it at once, so the test
            # shows the loss by the restores it causes, below)
            at_restart = load.total()
            wait_until(lambda: load.total() > at_restart + 1000, timeout=60)  # serving goes on
            wait_until(lambda: sum(s.status().extra["restores"] for s in stores) >= 1, timeout=30)
        assert not load.errors, load.errors
        truth = dict(load.recorded)
        wait_until(lambda: settled(stores, client, truth), timeout=30, step=0.1)
        after = in_redis(client, NS)
        # Every count Redis held before the loss is back, and none is counted twice: Redis holds exactly
        # what was recorded, through both replicas, before and after the restart.
        assert all(after[p] >= n for p, n in before.items())
        assert after == truth
        restored = sum(s.status().extra["restored_increments"] for s in stores)
        assert restored >= sum(before.values())
        assert any("lost the history of namespace" in r.getMessage() for r in caplog.records)
        assert all(s.status().healthy for s in stores)
    finally:
        for s in stores:
            s.close()
        client.close()
        server.stop()


def test_replicas_restoring_at_once_count_the_shared_history_once(tmp_path):
    """Three replicas with the same view restore together: the bases take the maximum, not the sum."""
    server = RedisProcess(tmp_path / "redis", persistent=False).start()
    stores = [open_store(server.url) for _ in range(3)]
    client = redis.Redis(port=server.port)
    try:
        memory = stores[0].memory(NS)
        for i, pattern in enumerate(PATTERNS[:50]):
            memory.record([pattern] * (i + 1))
        truth = {p: i + 1 for i, p in enumerate(PATTERNS[:50])}
        wait_until(lambda: settled(stores, client, truth), timeout=30, step=0.1)
        server.kill()
        server.start()
        barrier = threading.Barrier(3)

        def refresh(store: RedisStore) -> None:
            barrier.wait()
            wait_until(store.refresh, timeout=30, step=0.05)

        threads = [threading.Thread(target=refresh, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        wait_until(lambda: settled(stores, client, truth), timeout=30, step=0.1)
        assert in_redis(client, NS) == truth
        # the restored counts entered once, whoever restored them
        assert sum(s.status().extra["restored_increments"] for s in stores) == sum(truth.values())
    finally:
        for s in stores:
            s.close()
        client.close()
        server.stop()


def test_a_deliberate_reset_reaches_every_replica_and_is_never_restored(tmp_path):
    server = RedisProcess(tmp_path / "redis", persistent=False).start()
    a, b = open_store(server.url), open_store(server.url)
    client = redis.Redis(port=server.port)
    try:
        mem_a, mem_b = a.memory(NS), b.memory(NS)
        mem_a.record(PATTERNS[:20] * 3)
        truth = {p: 3 for p in PATTERNS[:20]}
        wait_until(lambda: settled([a, b], client, truth), timeout=30, step=0.1)

        a.reset(NS)  # the operator's `csd ocm reset`
        wait_until(lambda: mem_b.counts(PATTERNS[:20]) == [0] * 20, timeout=10)
        time.sleep(5 * b.refresh_interval_s)  # B's refreshes must not bring its old view back
        assert in_redis(client, NS) == {}
        assert b.status().extra["restores"] == 0 and a.status().extra["restores"] == 0

        # What both learn after the reset is what a later loss restores, nothing from before it.
        mem_b.record([PATTERNS[0]] * 2)
        wait_until(lambda: settled([a, b], client, {PATTERNS[0]: 2}), timeout=30, step=0.1)
        server.kill()
        server.start()
        for s in (a, b):
            wait_until(s.refresh, timeout=30, step=0.05)
        wait_until(lambda: settled([a, b], client, {PATTERNS[0]: 2}), timeout=30, step=0.1)
    finally:
        a.close()
        b.close()
        client.close()
        server.stop()


def test_a_new_replica_started_after_the_fleet_learned_serves_warm(tmp_path):
    """Its first `counts()` (the decoding core's first lookup) already sees the pooled memory: `memory()`
    reads it from Redis before the runtime serves anything."""
    server = RedisProcess(tmp_path / "redis").start()
    fleet = [open_store(server.url) for _ in range(2)]
    try:
        for i, store in enumerate(fleet):
            store.memory(NS).record([PATTERNS[i]] * 9)
        assert all(s.flush() for s in fleet)
        late = open_store(server.url)
        try:
            assert late.memory(NS).counts(PATTERNS[:2]) == [9, 9]
        finally:
            late.close()
    finally:
        for s in fleet:
            s.close()
        server.stop()
