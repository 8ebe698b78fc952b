"""Redis dies while a real CSD generation loop (embedded model) records divergence patterns, then comes back.

Generation must never fail, and after the reconnect Redis must hold exactly what was recorded: nothing lost
within the buffer bound, nothing counted twice.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import redis

from bench.redis_process import RedisProcess
from ocm_store import Namespace
from ocm_store.redis_store import RedisStore
from service.decoding import (
    Engine,
    Method,
    NgramDrafter,
    SamplingParams,
    SpeculativeConfig,
    run_alone,
    vocabulary_hash,
)
from service.decoding.text import encode_chat
from tests.ocm_store.helpers import in_redis, wait_until

ROOT = Path(__file__).resolve().parents[2]


class TallyingMemory:
    """A store's memory plus a tally of every pattern recorded through it: the truth to check Redis against."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.recorded: Counter[tuple[int, int]] = Counter()
        self._lock = threading.Lock()

    def record(self, patterns: Sequence[tuple[int, int]]) -> None:
        self.inner.record(patterns)
        with self._lock:
            self.recorded.update(patterns)

    def counts(self, patterns: Sequence[tuple[int, int]]) -> list[int]:
        return self.inner.counts(patterns)

    def total(self) -> int:
        with self._lock:
            return sum(self.recorded.values())


def prompts(embedded, kinds=("code_edit", "rewrite"), n=4) -> list[list[int]]:
    lines = (ROOT / "bench" / "data" / "grounded.jsonl").read_text().splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    chosen = [item for item in items if item["kind"] in kinds][:n]
    return [encode_chat(embedded.tokenizer, [{"role": "user", "content": it["prompt"]}]) for it in chosen]


def test_killing_redis_during_generation_loses_nothing(embedded, tmp_path):
    server = RedisProcess(tmp_path / "redis").start()
    store = RedisStore(server.url, flush_interval_s=0.05, refresh_interval_s=0.2, max_backoff_s=0.5)
    drafter = NgramDrafter()
    ns = Namespace(
        f"{embedded.name}@{embedded.revision}", drafter.identity, vocabulary_hash(embedded.tokenizer)
    )
    generation_memory = TallyingMemory(store.memory(ns))
    # A second namespace hammered the way verification calls the memory, for volume during the outage.
    hammer_ns = Namespace("hammer@0", "ngram", "v")
    hammer_memory = TallyingMemory(store.memory(hammer_ns))
    engine = Engine(embedded, {"ngram": drafter}, {"ngram": generation_memory})
    # lambda 1: rescues happen early, so the counts the loop reads matter to what it emits
    spec = SpeculativeConfig(method=Method.CSD, num_speculative_tokens=6, lambda_=1)
    inputs = prompts(embedded)
    stop = threading.Event()
    errors: list[BaseException] = []
    rounds = [0]

    def generate() -> None:
        try:
            i = 0
            while not stop.is_set():
                generation = engine.generate(inputs[i % len(inputs)], SamplingParams(max_tokens=24), spec)
                for _ in run_alone(generation):
                    rounds[0] += 1
                i += 1
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    def hammer() -> None:
        try:
            i = 0
            while not stop.is_set():
                pattern = (i % 97, i % 5)
                hammer_memory.record([pattern])
                hammer_memory.counts([pattern])
                i += 1
                time.sleep(0.0005)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=generate), threading.Thread(target=hammer)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: generation_memory.total() >= 2, timeout=300, step=0.05)

        server.kill()
        wait_until(lambda: not store.reachable(), timeout=30)
        rounds_at_kill, hammered_at_kill = rounds[0], hammer_memory.total()
        # Decoding goes on with Redis gone: more rounds, more increments buffered.
        wait_until(lambda: rounds[0] >= rounds_at_kill + 3, timeout=300, step=0.05)
        assert hammer_memory.total() > hammered_at_kill
        status = store.status()
        assert not status.healthy and status.extra["buffered_increments"] > 0

        server.start()
        wait_until(store.reachable, timeout=30, step=0.05)
        assert store.status().extra["reconnects"] >= 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=600)
    try:
        assert not errors, errors
        wait_until(store.flush, timeout=30, step=0.1)
        status = store.status()
        assert status.healthy and status.extra["dropped_increments"] == 0

        client = redis.Redis(port=server.port)
        for memory, namespace in ((generation_memory, ns), (hammer_memory, hammer_ns)):
            assert in_redis(client, namespace) == dict(memory.recorded)
            assert memory.counts(list(memory.recorded)) == list(memory.recorded.values())
        client.close()
    finally:
        store.close()
        server.stop()
