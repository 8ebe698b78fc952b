"""The in-process OCM store: the embedded default when no Redis is configured.

Counts live in a dict guarded by a lock (the hot path is a dict lookup). With a `path`, the store loads an
SQLite file at start and saves to it on a schedule (from a background thread, only when something changed)
and on close, so a single-machine user keeps the learned patterns across restarts. A file that cannot be
read is moved aside (`<name>.corrupt`) and the store starts empty and reports degraded; malformed rows are
skipped and counted.

Memory is bounded: when a namespace grows past `max_patterns` distinct patterns, the rarest patterns are
dropped until it holds 90 % of the cap (ties: the most recently inserted survive). Rare patterns are the ones
CSD cannot use anyway (a rescue needs count > lambda).
"""

from __future__ import annotations

import heapq
import logging
import sqlite3
import threading
import time
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


# What sqlite3 says about a file that is not (or no longer) an OCM file, as opposed to one it cannot get at
# right now (locked, permissions): only the former is moved aside.
_CORRUPT = ("not a database", "malformed", "no such column")


class InMemoryStore(OCMStore):
    backend = "memory"

    def __init__(
        self,
        path: Path | str | None = None,
        save_interval_s: float = 30.0,
        max_patterns: int = 200_000,
        busy_timeout_s: float = 10.0,
    ) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Namespace, Counter[tuple[int, int]]] = {}
        self.max_patterns = max_patterns
        self.evicted = 0
        self.path = Path(path) if path is not None else None
        self._dirty = False
        self._save_error = ""
        self._load_error = ""  # the file could not be read: degraded (until a later load works, if it can)
        self.busy_timeout_s = busy_timeout_s  # how long SQLite waits for another process's lock
        self.malformed = 0  # rows skipped at load
        self.saves = 0
        self.save_seconds_total = 0.0
        self.last_save_seconds = 0.0
        self._stop = threading.Event()
        self._saver: threading.Thread | None = None
        self._loaded = True
        if self.path is not None:
            self._loaded = self._load()
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
        problems = [e for e in (self._load_error, self._save_error) if e]
        if self.malformed:
            problems.append(f"skipped {self.malformed} malformed rows in {self.path}")
        return StoreStatus(
            backend=self.backend,
            healthy=not problems,
            patterns=total,
            detail="; ".join(problems) or (f"persisted to {self.path}" if self.path else "not persisted"),
            # The same keys as the Redis store, so both export the same metrics; zero where nothing is buffered.
            extra={
                "buffered_increments": 0,
                "dropped_increments": 0,
                "flushes": self.saves,
                "flush_seconds_total": self.save_seconds_total,
                "last_flush_seconds": self.last_save_seconds,
                "evicted": self.evicted,
                "reconnects": 0,
                "restores": 0,
                "restored_increments": 0,
                "malformed_values": self.malformed,
            },
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
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s)
        conn.execute(_SCHEMA)
        return conn

    def _load(self) -> bool:
        """Add the file's counts to memory. False when the file is there but out of reach for now (locked,
        unreadable): then nothing may be saved over it, and the next save tries the load again."""
        assert self.path is not None
        if not self.path.exists():
            return True
        try:
            with closing(self._connect()) as conn:
                rows = conn.execute(
                    "SELECT namespace, draft_token, target_token, count FROM patterns"
                ).fetchall()
        except sqlite3.DatabaseError as exc:
            if not any(sign in str(exc) for sign in _CORRUPT):
                self._load_error = f"cannot read {self.path} ({exc}); not saving until it can be read"
                log.error("OCM store: %s", self._load_error)
                return False
            # Not an OCM file: keep it for inspection under another name and start empty, so new patterns
            # can be saved; the status stays degraded so the loss is visible.
            aside = self.path.with_name(self.path.name + ".corrupt")
            try:
                self.path.replace(aside)
                kept = f"moved it to {aside}"
            except OSError as move_exc:
                kept = f"could not move it aside ({move_exc.strerror})"
            self._load_error = f"cannot read {self.path} ({exc}); started empty, {kept}"
            log.error("OCM store: %s", self._load_error)
            return True
        loaded: list[tuple[Namespace, tuple[int, int], int]] = []
        for key, d, t, c in rows:
            try:
                ns = Namespace.from_key(key)
                pattern, count = (int(d), int(t)), int(c)
                if min(*pattern, count) < 0:
                    raise ValueError("negative")
            except (TypeError, ValueError):
                self.malformed += 1
                continue
            loaded.append((ns, pattern, count))
        with self._lock:
            # Added, not set: after a late load, memory already holds what this process learned meanwhile.
            for ns, pattern, count in loaded:
                self._counts.setdefault(ns, Counter())[pattern] += count
            self._dirty = self._dirty or bool(self._counts)
        if self.malformed:
            log.warning("OCM store: skipped %d malformed rows in %s", self.malformed, self.path)
        self._load_error = ""
        return True

    def save(self) -> None:
        if self.path is None:
            return
        if not self._loaded:
            self._loaded = self._load()
            if not self._loaded:
                return  # never overwrite counts we could not read
        with self._lock:  # the engine thread records under this lock: copy only, build the rows outside it
            if not self._dirty:
                return
            copies = [(ns.key, dict(counter)) for ns, counter in self._counts.items()]
            self._dirty = False
        snapshot = [(key, d, t, c) for key, counter in copies for (d, t), c in counter.items()]
        started = time.perf_counter()
        try:
            with closing(self._connect()) as conn, conn:  # one transaction: readers never see half a save
                conn.execute("DELETE FROM patterns")
                conn.executemany("INSERT INTO patterns VALUES (?, ?, ?, ?)", snapshot)
            self._save_error = ""
            self.saves += 1
            self.last_save_seconds = time.perf_counter() - started
            self.save_seconds_total += self.last_save_seconds
        except sqlite3.Error as exc:
            with self._lock:
                self._dirty = True
            self._save_error = f"cannot save to {self.path}: {exc}"
            log.error("OCM store: %s", self._save_error)

    def _save_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.save()
