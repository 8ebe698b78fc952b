"""The in-process OCM store: the embedded default when no Redis is configured.

Counts live in a dict guarded by a lock (the hot path is a dict lookup). With a `path`, the store loads an
SQLite file at start and saves to it on a schedule (from a background thread, only when something changed)
and on close, so a single-machine user keeps the learned patterns across restarts.

Memory is bounded: when a namespace grows past `max_patterns` distinct patterns, the rarest patterns are
dropped until it holds 90 % of the cap (ties: the most recently inserted survive). Rare patterns are the ones
CSD cannot use anyway (a rescue needs count > lambda).
"""

from __future__ import annotations

import heapq
import logging
import sqlite3
import threading
from collections import Counter
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path

from ocm_store.base import Namespace, OCMStore, Pattern, StoreStatus

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS patterns (
    namespace TEXT NOT NULL,
    draft_token INTEGER NOT NULL,
    target_token INTEGER NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (namespace, draft_token, target_token)
)
"""


class InMemoryStore(OCMStore):
    backend = "memory"

    def __init__(
        self, path: Path | str | None = None, save_interval_s: float = 30.0, max_patterns: int = 200_000
    ) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Namespace, Counter[tuple[int, int]]] = {}
        self.max_patterns = max_patterns
        self.evicted = 0
        self.path = Path(path) if path is not None else None
        self._dirty = False
        self._save_error = ""
        self._stop = threading.Event()
        self._saver: threading.Thread | None = None
        if self.path is not None:
            self._load()
            self._saver = threading.Thread(
                target=self._save_loop, args=(save_interval_s,), name="ocm-save", daemon=True
            )
            self._saver.start()

    # ------------------------------------------------------------ the OCMStore interface

    def record(self, namespace: Namespace, patterns: Sequence[tuple[int, int]]) -> None:
        with self._lock:
            counter = self._counts.get(namespace)
            if counter is None:
                counter = self._counts[namespace] = Counter()
            for pattern in patterns:
                counter[pattern] += 1
            if len(counter) > self.max_patterns:
                self._evict(counter)
            self._dirty = True

    def counts(self, namespace: Namespace, patterns: Sequence[tuple[int, int]]) -> list[int]:
        with self._lock:
            counter = self._counts.get(namespace)
            if counter is None:
                return [0] * len(patterns)
            return [counter.get(p, 0) for p in patterns]

    def top(self, namespace: Namespace, n: int = 20) -> list[Pattern]:
        with self._lock:
            counter = self._counts.get(namespace, Counter())
            best = heapq.nlargest(n, counter.items(), key=lambda kv: kv[1])
        return [Pattern(d, t, c) for (d, t), c in best]

    def namespaces(self) -> list[Namespace]:
        with self._lock:
            return [ns for ns, c in self._counts.items() if c]

    def reset(self, namespace: Namespace | None = None) -> None:
        with self._lock:
            if namespace is None:
                self._counts.clear()
            else:
                self._counts.pop(namespace, None)
            self._dirty = True
        self.save()

    def status(self) -> StoreStatus:
        with self._lock:
            total = sum(len(c) for c in self._counts.values())
        healthy = not self._save_error
        return StoreStatus(
            backend=self.backend,
            healthy=healthy,
            patterns=total,
            detail=self._save_error or (f"persisted to {self.path}" if self.path else "not persisted"),
            extra={"evicted": self.evicted},
        )

    def close(self) -> None:
        self._stop.set()
        if self._saver is not None:
            self._saver.join(timeout=5)
        self.save()

    def merge(self, namespace: Namespace, items: Sequence[tuple[int, int, int]]) -> None:
        with self._lock:
            counter = self._counts.setdefault(namespace, Counter())
            for d, t, c in items:
                counter[(d, t)] += c
            if len(counter) > self.max_patterns:
                self._evict(counter)
            self._dirty = True

    # ------------------------------------------------------------ internals

    def _evict(self, counter: Counter[tuple[int, int]]) -> None:
        keep = int(self.max_patterns * 0.9)
        # Counter preserves insertion order, and nlargest is stable, so among equal counts the older
        # patterns go first.
        survivors = heapq.nlargest(keep, reversed(list(counter.items())), key=lambda kv: kv[1])
        self.evicted += len(counter) - len(survivors)
        counter.clear()
        counter.update(dict(survivors))

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=10)
        conn.execute(_SCHEMA)
        return conn

    def _load(self) -> None:
        try:
            with closing(self._connect()) as conn:
                rows = conn.execute(
                    "SELECT namespace, draft_token, target_token, count FROM patterns"
                ).fetchall()
        except sqlite3.DatabaseError as exc:
            self._save_error = f"cannot read {self.path}: {exc}"
            log.error("OCM store: %s; starting empty", self._save_error)
            return
        for key, d, t, c in rows:
            try:
                ns = Namespace.from_key(key)
            except ValueError:
                continue
            self._counts.setdefault(ns, Counter())[(int(d), int(t))] = int(c)

    def save(self) -> None:
        if self.path is None:
            return
        with self._lock:
            if not self._dirty:
                return
            snapshot = [
                (ns.key, d, t, c) for ns, counter in self._counts.items() for (d, t), c in counter.items()
            ]
            self._dirty = False
        try:
            with closing(self._connect()) as conn, conn:  # one transaction: readers never see half a save
                conn.execute("DELETE FROM patterns")
                conn.executemany("INSERT INTO patterns VALUES (?, ?, ?, ?)", snapshot)
            self._save_error = ""
        except sqlite3.Error as exc:
            with self._lock:
                self._dirty = True
            self._save_error = f"cannot save to {self.path}: {exc}"
            log.error("OCM store: %s", self._save_error)

    def _save_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.save()
