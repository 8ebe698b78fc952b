"""The shared OCM in Redis: every replica learns from every other one, and a restart loses nothing.

Never on the hot path. `record()` and `counts()` touch only process memory under one lock:
- a *snapshot* per namespace: the counts Redis held at the last refresh (or at our last flush);
- a *buffer*: increments not yet sent, and at most one *in-flight* batch being sent.
`counts()` returns snapshot + in flight + buffer. A background worker flushes the buffer as one pipelined
round trip (a Lua script per namespace: ZINCRBY each pattern, stamp the change log, apply the cap) at most
every `flush_interval_s`, sooner once `flush_every` increments are waiting; the script answers the new
absolute counts, which replace the snapshot entries, so nothing is counted twice. Every
`refresh_interval_s` the worker pulls what other replicas wrote: incrementally (only the patterns stamped
since the last seq it saw, see `redis_scripts`), or the whole set after an eviction, a reset or a Redis that
lost its data. A pattern learned on replica A reaches replica B within flush + refresh interval (0.6 s by
default).

Bounded memory. Redis: at most `max_patterns` per namespace; past that the flush script drops the rarest
patterns down to 90 % of the cap (a rank range on the sorted set, cheap for Redis; among equal counts in
Redis's order of equal scores, by member). Process: the snapshot mirrors the capped set; the buffer holds at most `max_buffered` distinct patterns per namespace (default: the cap).
An increment of a pattern already buffered always fits; one of a new pattern past the bound is dropped and
counted (`dropped_increments`), never silently.

Faults. Redis unreachable at start: the store works local-only (the buffer is the memory) and reports
degraded. Lost mid-run: decoding goes on; increments stay buffered up to the bound and are flushed once a
reconnect (exponential backoff up to `max_backoff_s`) succeeds. Each batch carries (writer id, batch number)
and the script skips a batch it already applied, so a retry after a lost reply never counts twice. Still
unreachable at shutdown: what is buffered is spilled to `spill_dir` (see `ocm_store.spill`) with those batch
ids, and the next store opened on that folder replays it before its own increments, so a Redis outage plus a
restart loses nothing and a replay that is cut short and repeated never counts twice. Junk in
Redis (a score that is not a whole count, a member that is not "draft:target", a key of the wrong type) is
skipped and logged, and the status says so; a junk count is overwritten by the next increment of it.

Redis that loses data (no persistence and a restart, a failover to a replica that had not caught up, a
flushed instance). Every replica holds a view of the pooled counts. A refresh (or a flush reply) that finds
the namespace's `gen` gone or changed means the history is lost: the replica writes its view back through
the RESTORE script, which takes the maximum per pattern over the replicas' views plus every increment since
(see `redis_scripts`: never counted twice, however many replicas restore at once), logs it at WARNING and
counts it (`restores`, `restored_increments`). After a reconnect, or when the seq went backwards, the view
is checked against Redis and any count Redis lacks is raised back to it. A deliberate `reset` keeps the gen
and moves the epoch, so it is reloaded (forgotten) by every replica, never restored.

Security. The URL goes to redis-py through `ocm_store.urls` (a server, a Sentinel service or a Cluster;
password, ACL user, TLS with redis-py's `ssl_*` query options); this module only ever shows it masked, and scrubs the password out of any error text.

Layout. `RedisStore` (here) holds the state, the public methods and the hot path; what it does with Redis
sits in one sibling module per concern, each a mixin of its methods, so that a change to one path (say, how
a lost history is restored) reads in one file:

| module | what |
|---|---|
| `redis_local.py` | `_Local`: what this process holds for one namespace (snapshot, buffer, in-flight batch, change tracking) |
| `redis_link.py` | the link: connecting, losing it, backoff, the background worker, calling the Lua scripts |
| `redis_flush.py` | the write side: sending the buffers as idempotent batches through the FLUSH script |
| `redis_refresh.py` | the read side: pulling other replicas' counts, restoring a lost history, whole-set reads |
| `redis_spill.py` | spilling what is buffered at shutdown while Redis is away, and replaying it on the next start |
| `redis_scripts.py` | the Lua scripts themselves |
"""  # noqa: E501

from __future__ import annotations

import hashlib
import heapq
import logging
import secrets
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ocm_store import keys, redis_scripts
from ocm_store.base import (
    Namespace,
    NamespacedMemory,
    OCMStore,
    OCMStoreError,
    Pattern,
    StoreStatus,
    StoreUnavailableError,
)
from ocm_store.redaction import Scrubber, mask_url
from ocm_store.redis_flush import FlushMixin
from ocm_store.redis_link import _LINK_ERRORS, LinkMixin
from ocm_store.redis_local import BATCH_PATTERNS, Pair, _Local
from ocm_store.redis_refresh import MAX_DELTA, MAX_JUNK_TRACKED, SCAN_SLICE, TOP_RANGE_MAX, RefreshMixin
from ocm_store.redis_spill import SpillMixin
from ocm_store.urls import open_client

__all__ = [
    "BATCH_PATTERNS",
    "MAX_DELTA",
    "MAX_JUNK_TRACKED",
    "SCAN_SLICE",
    "TOP_RANGE_MAX",
    "Pair",
    "RedisStore",
]

log = logging.getLogger(__name__)


class RedisStore(LinkMixin, FlushMixin, RefreshMixin, SpillMixin, OCMStore):
    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        max_patterns: int = 200_000,
        flush_interval_s: float = 0.1,
        refresh_interval_s: float = 0.5,
        flush_every: int = 1024,
        max_buffered: int | None = None,
        connect_timeout_s: float = 1.0,
        command_timeout_s: float = 5.0,
        max_backoff_s: float = 5.0,
        spill_dir: Path | None = None,
    ) -> None:
        self.url = mask_url(url)  # the only form of the URL this object keeps
        self._scrub = Scrubber(url)
        try:
            self._client = open_client(
                url,
                socket_connect_timeout=connect_timeout_s,
                socket_timeout=command_timeout_s,
                # Our worker does the retrying, with backoff, off the hot path; redis-py must not retry
                # inside a call (its default sleeps up to seconds).
                retry=Retry(NoBackoff(), 0),
                client_name="csd-ocm",
            )
        except (ValueError, TypeError) as exc:
            raise OCMStoreError(f"invalid Redis URL {self.url}: {self._scrub(str(exc))}") from None
        self.max_patterns = max_patterns
        self.keep_patterns = max(1, int(max_patterns * 0.9))
        self.max_buffered = max_buffered if max_buffered is not None else max_patterns
        self.flush_interval_s = flush_interval_s
        self.refresh_interval_s = refresh_interval_s
        self.flush_every = flush_every
        self.max_backoff_s = max_backoff_s
        self._writer = secrets.token_hex(8)  # this instance's id for idempotent batches
        self._next_batch = 0
        # EVALSHA with hashes computed here; the scripts are loaded on the first NOSCRIPT answer (a fresh
        # or restarted server), not checked before every pipeline as redis-py's Script objects do.
        self._scripts = {
            name: (text, hashlib.sha1(text.encode()).hexdigest())
            for name, text in (
                ("flush", redis_scripts.FLUSH),
                ("refresh", redis_scripts.REFRESH),
                ("reset", redis_scripts.RESET),
                ("restore", redis_scripts.RESTORE),
            )
        }

        self._lock = threading.Lock()  # process state; held for dict operations only
        self._io = threading.RLock()  # one conversation with Redis at a time (worker or a caller)
        self._states: dict[Namespace, _Local] = {}
        self._connected = False
        self._link_error = ""
        self._backoff = 0.0
        self._next_attempt = 0.0
        self._next_refresh = 0.0
        self._since_wake = 0
        # counters exported as metrics (see status())
        self._buffered_total = 0
        self._dropped = 0
        self._flushes = 0
        self._flush_seconds = 0.0
        self._last_flush_seconds = 0.0
        self._evicted = 0
        self._reconnects = 0
        self._restores = 0
        self._restored_increments = 0
        self._ever_lost = False

        self.spill_dir = spill_dir
        self._spill_files: list[Path] = []  # loaded spill files, deleted once everything in them is sent
        if spill_dir is not None:
            self._load_spill(spill_dir)

        self._stop = threading.Event()
        self._wake = threading.Event()
        with self._io:
            self._connect()
        self._worker = threading.Thread(target=self._run, name="ocm-redis", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ the hot path (process memory only)

    def record(self, namespace: Namespace, patterns: Sequence[Pair]) -> None:
        with self._lock:
            self._add(self._state(namespace), ((p, 1) for p in patterns), bounded=True)

    def counts(self, namespace: Namespace, patterns: Sequence[Pair]) -> list[int]:
        with self._lock:
            local = self._states.get(namespace)
            if local is None:
                local = self._state(namespace)  # the worker loads it from Redis on its next refresh
            return [local.view(p) for p in patterns]

    def memory(self, namespace: Namespace) -> NamespacedMemory:
        """Bind a namespace and load its pooled counts now (at start-up, not on the hot path)."""
        with self._lock:
            self._state(namespace)
        with self._io:
            if self._connected:
                try:
                    self._refresh([namespace])
                except _LINK_ERRORS as exc:
                    self._lost(exc)
        return super().memory(namespace)

    # ------------------------------------------------------------ tools (may talk to Redis)

    def top(self, namespace: Namespace, n: int = 20) -> list[Pattern]:
        """From Redis (after sending what is buffered here); from the local view while Redis is away."""
        with self._io:
            if self._connected:
                try:
                    self._flush_all()
                    return self._top_in_redis(namespace, n)
                except _LINK_ERRORS as exc:
                    self._lost(exc)
                except redis.ResponseError as exc:
                    log.error("OCM store: cannot read namespace %s: %s", namespace.key, self._scrub(str(exc)))
        with self._lock:
            local = self._states.get(namespace)
            counts = local.merged() if local else {}
        best = heapq.nlargest(n, counts.items(), key=lambda kv: kv[1])
        return [Pattern(d, t, c) for (d, t), c in best]

    def merge(self, namespace: Namespace, items: Sequence[tuple[int, int, int]]) -> None:
        """Add exported rows. Connected: sent now, in batches; else buffered (bounded) like `record`."""
        with self._io:
            for start in range(0, len(items), BATCH_PATTERNS):
                chunk = items[start : start + BATCH_PATTERNS]
                with self._lock:
                    self._add(
                        self._state(namespace),
                        (((d, t), c) for d, t, c in chunk if c > 0),
                        bounded=not self._connected,
                    )
                if self._connected:
                    self.flush()
        if not self._connected:
            raise StoreUnavailableError(
                f"OCM Redis at {self.url} is unreachable ({self._link_error}): the rows are buffered and "
                "will be sent on reconnect, up to the buffer bound"
            )

    def namespaces(self) -> list[Namespace]:
        found: dict[Namespace, None] = {}
        with self._io:
            if self._connected:
                try:
                    for _nid, ns in self._registry():
                        if ns is not None:
                            found[ns] = None
                except _LINK_ERRORS as exc:
                    self._lost(exc)
        with self._lock:
            for ns, local in self._states.items():
                if local.snapshot or local.buffer or local.inflight:
                    found[ns] = None
        return list(found)

    def reset(self, namespace: Namespace | None = None) -> None:
        with self._io:
            with self._lock:
                targets = [namespace] if namespace is not None else list(self._states)
                for ns in targets:
                    if ns in self._states:
                        self._forget_local(self._states[ns])
            if not self._connected:
                raise StoreUnavailableError(
                    f"OCM Redis at {self.url} is unreachable ({self._link_error}): only this process's "
                    "view was reset"
                )
            try:
                ids = {keys.namespace_id(ns) for ns in targets}
                if namespace is None:  # also entries that do not parse: their keys follow from the id
                    ids.update(nid for nid, _ns in self._registry())
                for _attempt in range(2):
                    pipe = self._client.pipeline(transaction=False)
                    for nid in sorted(ids):
                        self._script(pipe, "reset", keys.keys_for_id(nid).all)
                        pipe.hdel(keys.REGISTRY, nid)
                    results = pipe.execute(raise_on_error=False)
                    if not self._needs_scripts(results):
                        break
            except _LINK_ERRORS as exc:
                self._lost(exc)
                raise StoreUnavailableError(
                    f"OCM Redis at {self.url} was lost during the reset ({self._link_error})"
                ) from None
            failures = [r for r in results if isinstance(r, Exception)]
            if failures:
                raise OCMStoreError(f"reset incomplete: {self._scrub(str(failures[0]))}")
            self._next_refresh = 0.0

    def status(self) -> StoreStatus:
        with self._lock:
            patterns = sum(
                len(s.snapshot) + sum(1 for p in s.buffer if p not in s.snapshot)
                for s in self._states.values()
            )
            junk = sum(len(s.junk) for s in self._states.values())
            errors = [(ns, s.error) for ns, s in self._states.items() if s.error]
            buffered = self._buffered_total
            extra = {
                "buffered_increments": buffered,
                "dropped_increments": self._dropped,
                "flushes": self._flushes,
                "flush_seconds_total": self._flush_seconds,
                "last_flush_seconds": self._last_flush_seconds,
                "evicted": self._evicted,
                "reconnects": self._reconnects,
                "restores": self._restores,
                "restored_increments": self._restored_increments,
                "malformed_values": junk,
            }
        if not self._connected:
            detail = (
                f"{self.url} unreachable ({self._link_error}); working local-only, "
                f"{buffered} increments buffered for the reconnect"
            )
        elif errors:
            ns, error = errors[0]
            detail = f"{self.url} connected, but namespace {ns.key}: {error}"
        elif junk:
            detail = f"{self.url} connected; skipped {junk} malformed values (not 'draft:target' -> count)"
        else:
            detail = f"{self.url} connected"
        healthy = self._connected and not errors and not junk
        return StoreStatus(self.backend, healthy, patterns, detail, extra)

    def flush(self) -> bool:
        """Send everything buffered now. True when nothing is left buffered."""
        with self._io:
            if not self._connected:
                return False
            try:
                self._flush_all()
            except _LINK_ERRORS as exc:
                self._lost(exc)
        with self._lock:
            return self._buffered_total == 0

    def refresh(self) -> bool:
        """Pull what other replicas wrote now (the worker does it every `refresh_interval_s`)."""
        with self._io:
            if not self._connected:
                return False
            try:
                self._refresh(list(self._states))
            except _LINK_ERRORS as exc:
                self._lost(exc)
            return self._connected

    def reachable(self) -> bool:
        return self._connected

    def close(self) -> None:
        if self._stop.is_set():
            return  # closed already
        self._stop.set()
        self._wake.set()
        if self._worker.is_alive():
            self._worker.join(timeout=10)
        with self._io:
            if not self._connected:
                self._connect()  # one last chance for what is buffered
            self.flush()
            with self._lock:
                left = self._buffered_total
                spilled = self._spill() if left and self.spill_dir is not None else None
                if left and spilled is None:
                    self._dropped += left
            if spilled is not None:
                log.warning(
                    "OCM store: %d increments could not reach %s; spilled to %s, replayed on the next start",
                    left,
                    self.url,
                    spilled,
                )
            elif left:
                log.warning("OCM store: %d increments could not reach %s and are lost", left, self.url)
            self._client.close()

    # ------------------------------------------------------------ local state

    def _state(self, namespace: Namespace) -> _Local:
        local = self._states.get(namespace)
        if local is None:
            local = self._states[namespace] = _Local(keys.keys_for(namespace))
        return local

    def _add(self, local: _Local, increments: Iterable[tuple[Pair, int]], bounded: bool) -> None:
        """Buffer increments (caller holds _lock). Past the bound, a new pattern is dropped and counted."""
        buf = local.buffer
        added = 0
        for pattern, n in increments:
            if pattern in buf:
                buf[pattern] += n
            elif not bounded or len(buf) < self.max_buffered:
                buf[pattern] = n
            else:
                self._dropped += n
                continue
            added += n
        local.buffered += added
        self._buffered_total += added
        self._since_wake += added
        if self._since_wake >= self.flush_every:
            self._since_wake = 0
            self._wake.set()

    def _forget_local(self, local: _Local) -> None:
        dropped = local.buffered
        local.snapshot, local.buffer, local.inflight, local.buffered = {}, {}, None, 0
        local.junk.clear()
        local.epoch = ""
        self._buffered_total -= dropped
