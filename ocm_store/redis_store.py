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
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
from ocm_store.spill import SpilledBatch, read_spills, remove_spills, write_spill
from ocm_store.urls import open_client

log = logging.getLogger(__name__)

# Connection-level failures: the link is gone (or not yet back); anything else is an answer from Redis.
_LINK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
BATCH_PATTERNS = 5000  # patterns per script call: bounds one call's time on the server
TOP_RANGE_MAX = 10_000  # top(n) up to this n reads one rank range; beyond, the whole set in slices
SCAN_SLICE = 5000  # members per ZSCAN call of a full reload
MAX_DELTA = 20_000  # more changed patterns than this since the last refresh: read the whole set instead
MAX_JUNK_TRACKED = 1000  # junk fields remembered per namespace (for status and to log each once)

Pair = tuple[int, int]


@dataclass
class _Local:
    """What this process holds for one namespace. Guarded by RedisStore._lock."""

    keys: keys.NamespaceKeys
    snapshot: dict[Pair, int] = field(default_factory=dict)  # absolute counts, as Redis last told us
    buffer: dict[Pair, int] = field(default_factory=dict)  # increments not sent yet
    inflight: dict[Pair, int] | None = None  # the batch being sent (kept as-is until Redis confirms it)
    inflight_batch: int = 0
    inflight_writer: str = ""
    replay: list[SpilledBatch] = field(default_factory=list)  # spilled by an earlier store, sent first
    buffered: int = 0  # sum of buffer and inflight values
    # change tracking: what we have seen of meta (see redis_scripts)
    seq: int = 0
    gen: str = ""
    epoch: str = ""  # "" matches no epoch in Redis: the first refresh reads the whole set
    junk: set[bytes] = field(default_factory=set)
    verify: bool = False  # after a reconnect: check that Redis still holds at least this view (a failover)
    error: str = ""  # the last answer Redis gave for this namespace that was an error
    retry_at: float = 0.0

    def view(self, pattern: Pair) -> int:
        n = self.snapshot.get(pattern, 0) + self.buffer.get(pattern, 0)
        for batch in self.replay:
            n += batch.patterns.get(pattern, 0)
        return n + self.inflight.get(pattern, 0) if self.inflight else n

    def merged(self) -> dict[Pair, int]:
        out = dict(self.snapshot)
        for part in (self.inflight or {}, self.buffer, *(b.patterns for b in self.replay)):
            for p, n in part.items():
                out[p] = out.get(p, 0) + n
        return out


class RedisStore(OCMStore):
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

    # ------------------------------------------------------------ the spill (Redis away at shutdown)

    def _load_spill(self, folder: Path) -> None:
        files, spilled = read_spills(folder)
        with self._lock:
            for ns, batch in spilled:
                local = self._state(ns)
                local.replay.append(batch)
                n = sum(batch.patterns.values())
                local.buffered += n
                self._buffered_total += n
        self._spill_files = files
        if spilled:
            log.info(
                "OCM store: replaying %d increments spilled by an earlier shutdown (%s)",
                sum(sum(b.patterns.values()) for _ns, b in spilled),
                ", ".join(str(f) for f in files),
            )

    def _spill(self) -> Path | None:
        """Everything still buffered, as batches with their ids (caller holds _lock and _io). Replaces the
        spill files this store loaded: what they held and was not sent is in the new one."""
        assert self.spill_dir is not None
        batches: list[tuple[Namespace, SpilledBatch]] = []
        for ns, local in self._states.items():
            batches += [(ns, b) for b in local.replay]
            if local.inflight:  # may have been applied with its reply lost: same id, Redis decides
                batches.append(
                    (ns, SpilledBatch(local.inflight_writer, local.inflight_batch, local.inflight))
                )
            if local.buffer:  # never sent: the next number of this writer
                self._next_batch += 1
                batches.append((ns, SpilledBatch(self._writer, self._next_batch, dict(local.buffer))))
        path = write_spill(self.spill_dir, self._writer, batches)
        if path is not None:
            remove_spills([f for f in self._spill_files if f != path])
            self._spill_files = []
        return path

    def _forget_replayed_spills(self) -> None:
        """Delete the loaded spill files once every batch in them reached Redis (caller holds _io)."""
        if not self._spill_files:
            return
        with self._lock:
            pending = any(
                local.replay or (local.inflight is not None and local.inflight_writer != self._writer)
                for local in self._states.values()
            )
        if not pending:
            remove_spills(self._spill_files)
            log.info("OCM store: the spilled increments reached %s", self.url)
            self._spill_files = []

    # ------------------------------------------------------------ local state

    def _script(self, pipe, name: str, keys_: list[str], args: Sequence = ()) -> None:
        # execute_command, not pipe.evalsha: redis-py's cluster pipeline blocks the evalsha method (it cannot
        # know the keys are in one slot); the command itself is routed by its first key, and every script's
        # keys share the namespace's hash tag (keys.py).
        pipe.execute_command("EVALSHA", self._scripts[name][1], len(keys_), *keys_, *args)

    def _needs_scripts(self, results: list) -> bool:
        """True (after loading the scripts) when the server did not know them: run the pipeline again."""
        if not any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
            return False
        for text, _sha in self._scripts.values():
            self._client.script_load(text)
        return True

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

    # ------------------------------------------------------------ the worker

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._io:
                if not self._connected and time.monotonic() >= self._next_attempt:
                    self._connect()
                if self._connected:
                    try:
                        self._flush_all()
                        if time.monotonic() >= self._next_refresh:
                            self._refresh(list(self._states))
                            self._next_refresh = time.monotonic() + self.refresh_interval_s
                    except _LINK_ERRORS as exc:
                        self._lost(exc)
                    except Exception:  # a bug must not kill the worker: log it and carry on
                        log.exception("OCM store: background worker error")
                connected = self._connected
            if connected:
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
            else:  # not the wake event: record() would spin us while nothing can be sent
                self._stop.wait(max(0.0, min(self._next_attempt - time.monotonic(), 1.0)))

    def _connect(self) -> None:
        try:
            self._client.ping()
        except redis.RedisError as exc:  # refused, timed out, wrong password, TLS failure ...
            self._lost(exc)
            return
        if self._ever_lost:
            self._reconnects += 1
            log.warning(
                "OCM store: reconnected to %s; sending %d buffered increments", self.url, self._buffered_total
            )
        else:
            log.info("OCM store: connected to %s", self.url)
        self._connected = True
        self._link_error = ""
        self._backoff = 0.0
        self._next_refresh = 0.0
        if self._ever_lost:  # perhaps another server now (a failover): check it holds what we saw
            with self._lock:
                for local in self._states.values():
                    local.verify = True

    def _lost(self, exc: BaseException) -> None:
        error = self._scrub(f"{type(exc).__name__}: {exc}")
        if self._connected or not self._ever_lost or error != self._link_error:
            log.warning(
                "OCM store: Redis at %s unavailable (%s); decoding goes on with the local view",
                self.url,
                error,
            )
        self._connected = False
        self._ever_lost = True
        self._link_error = error
        self._backoff = min(self.max_backoff_s, max(0.1, self._backoff * 2))
        self._next_attempt = time.monotonic() + self._backoff

    def _flush_all(self) -> None:
        """Send every namespace's buffer, one pipelined round trip per round of batches (caller holds _io)."""
        scripts_loaded = False
        while True:
            sent: list[tuple[Namespace, _Local, list[Pair]]] = []
            pipe = self._client.pipeline(transaction=False)
            now = time.monotonic()
            with self._lock:
                self._since_wake = 0
                for ns, local in self._states.items():
                    if local.retry_at > now:
                        continue
                    if local.inflight is None and local.replay:  # spilled batches first, with their ids
                        batch = local.replay.pop(0)
                        local.inflight = batch.patterns
                        local.inflight_batch, local.inflight_writer = batch.batch, batch.writer
                    elif local.inflight is None and local.buffer:
                        local.inflight = self._take_batch(local)
                        self._next_batch += 1
                        local.inflight_batch, local.inflight_writer = self._next_batch, self._writer
                    if local.inflight is None:
                        continue
                    fields = list(local.inflight)
                    args: list = [
                        local.inflight_writer,
                        local.inflight_batch,
                        self.max_patterns,
                        self.keep_patterns,
                        # a fresh token each time: a gen must never come back after a loss (one token per
                        # store would, if this store started the namespace and then refilled it)
                        secrets.token_hex(8),
                    ]
                    for d, t in fields:
                        args += [keys.pattern_field(d, t), local.inflight[(d, t)]]
                    self._script(pipe, "flush", local.keys.all[:4], args)
                    pipe.hset(keys.REGISTRY, local.keys.id, ns.key)
                    sent.append((ns, local, fields))
            if not sent:
                return
            started = time.perf_counter()
            results = pipe.execute(raise_on_error=False)  # a link error raises: the batches stay in flight
            elapsed = time.perf_counter() - started
            if not scripts_loaded and self._needs_scripts(results):
                scripts_loaded = True
                continue  # nothing ran; the batches are still in flight and go again (idempotent anyway)
            more = False
            with self._lock:
                self._flushes += 1
                self._flush_seconds += elapsed
                self._last_flush_seconds = elapsed
                for (ns, local, fields), result in zip(sent, results[0::2], strict=True):
                    if isinstance(result, Exception):
                        self._namespace_error(ns, local, result)
                        continue
                    _applied, _seq, evicted, repaired, values, gen = result
                    self._evicted += int(evicted)
                    if local.gen and gen.decode() != local.gen:
                        # Redis lost the namespace's history: these counts are the emptied Redis's, not
                        # the pool's. The view stays as it is for the restore, which the next refresh does.
                        self._next_refresh = 0.0
                    else:
                        for pattern, value in zip(fields, values, strict=True):
                            count = keys.parse_count(value)
                            if count is None:
                                local.snapshot.pop(pattern, None)  # evicted (or junk again already)
                            else:
                                local.snapshot[pattern] = count
                            local.junk.discard(keys.pattern_field(*pattern).encode())
                    sent_total = sum(local.inflight.values()) if local.inflight else 0
                    local.inflight = None
                    local.buffered -= sent_total
                    self._buffered_total -= sent_total
                    local.error = ""
                    if evicted:
                        self._next_refresh = 0.0  # the epoch moved: reload the capped set soon
                    if repaired:
                        log.warning(
                            "OCM store: overwrote %d malformed counts in namespace %s", repaired, ns.key
                        )
                    more = more or bool(local.buffer) or bool(local.replay)
            if not more:
                self._forget_replayed_spills()
                return

    def _take_batch(self, local: _Local) -> dict[Pair, int]:
        if len(local.buffer) <= BATCH_PATTERNS:
            batch, local.buffer = local.buffer, {}
            return batch
        batch = {}
        for pattern in list(local.buffer)[:BATCH_PATTERNS]:
            batch[pattern] = local.buffer.pop(pattern)
        return batch

    def _namespace_error(self, ns: Namespace, local: _Local, exc: Exception) -> None:
        error = self._scrub(str(exc))
        if error != local.error:
            log.error("OCM store: Redis refused namespace %s: %s", ns.key, error)
        local.error = error
        local.retry_at = time.monotonic() + self.max_backoff_s

    def _refresh(self, namespaces: list[Namespace]) -> None:
        """Pull what other replicas wrote (caller holds _io)."""
        if not namespaces:
            return
        for _attempt in range(2):
            pipe = self._client.pipeline(transaction=False)
            with self._lock:
                todo = [(ns, self._state(ns)) for ns in namespaces]
                for _ns, local in todo:
                    self._script(
                        pipe, "refresh", local.keys.all[:3], [local.seq, local.gen, local.epoch, MAX_DELTA]
                    )
            results = pipe.execute(raise_on_error=False)
            if not self._needs_scripts(results):
                break
        restored: list[Namespace] = []
        for (ns, local), result in zip(todo, results, strict=True):
            if isinstance(result, Exception):
                with self._lock:
                    self._namespace_error(ns, local, result)
                continue
            gen, seq, epoch, mode = result[0].decode(), int(result[1]), result[2].decode(), result[3]
            loss = self._loss(local, gen, seq, epoch)
            if loss is not None:
                self._restore(ns, local, loss)
                restored.append(ns)
                continue
            if mode == b"full":
                try:
                    fresh, junk = self._scan(local.keys.counts)
                except redis.ResponseError as exc:  # the key changed type since the script looked
                    with self._lock:
                        self._namespace_error(ns, local, exc)
                    continue
            elif mode == b"delta":
                fresh, junk = self._parse(result[4], result[5])
            else:
                fresh, junk = None, set()
            new_junk = junk - local.junk
            if new_junk:
                sample = sorted(new_junk)[:3]
                log.warning(
                    "OCM store: skipped %d malformed values in namespace %s (fields %s)",
                    len(new_junk),
                    ns.key,
                    ", ".join(repr(f) for f in sample),
                )
            with self._lock:
                if mode == b"full":
                    local.snapshot = fresh
                    local.junk = set(list(junk)[:MAX_JUNK_TRACKED])
                elif mode == b"delta":
                    local.snapshot.update(fresh)
                    if len(local.junk) < MAX_JUNK_TRACKED:
                        local.junk |= set(list(junk)[: MAX_JUNK_TRACKED - len(local.junk)])
                    local.junk -= {keys.pattern_field(*p).encode() for p in fresh}
                local.seq, local.gen, local.epoch = seq, gen, epoch
                if local.inflight is None:
                    local.error = ""
        if restored:
            self._refresh(restored)  # a full reload: the pool's counts after the restore

    def _loss(self, local: _Local, gen: str, seq: int, epoch: str) -> str | None:
        """'lost' when Redis no longer has the namespace's history that this view came from (its gen is
        gone or another), 'behind' when it may hold fewer counts than this view (its seq went backwards, or
        it may be another server after a reconnect), None when it cannot have lost anything we saw. A reset
        or an eviction keeps the gen and moves the epoch: that is a reload, never a restore."""
        with self._lock:
            verify, local.verify = local.verify, False
            if not local.gen or not local.snapshot:
                return None  # nothing seen, nothing to restore
            if gen != local.gen:
                return "lost"
            if epoch == local.epoch and (seq < local.seq or verify):
                return "behind"
            return None

    def _restore(self, ns: Namespace, local: _Local, loss: str) -> None:
        """Send this replica's view back to Redis through the RESTORE script (see redis_scripts for why it
        never counts twice, however many replicas restore at once); caller holds _io."""
        with self._lock:
            view = list(local.snapshot.items())
            gen_seen, epoch_seen = local.gen, local.epoch
        added = raised = 0
        gen = gen_seen
        for start in range(0, len(view), BATCH_PATTERNS):
            args: list = [loss, gen_seen, epoch_seen, secrets.token_hex(8), self.max_patterns,
                          self.keep_patterns]  # fmt: skip
            for (d, t), n in view[start : start + BATCH_PATTERNS]:
                args += [keys.pattern_field(d, t), n]
            for _attempt in range(2):
                pipe = self._client.pipeline(transaction=False)
                self._script(pipe, "restore", local.keys.all, args)
                pipe.hset(keys.REGISTRY, local.keys.id, ns.key)
                results = pipe.execute(raise_on_error=False)
                if not self._needs_scripts(results):
                    break
            if isinstance(results[0], Exception):
                with self._lock:
                    self._namespace_error(ns, local, results[0])
                return
            outcome, new_gen, n_added, n_raised = results[0]
            if outcome == b"stale":  # nothing lost relative to this view after all: a plain reload
                break
            gen = new_gen.decode()
            added, raised = added + int(n_added), raised + int(n_raised)
        with self._lock:
            local.gen, local.epoch, local.seq = gen, "", 0  # the next refresh reads everything
            if added:
                self._restores += 1
                self._restored_increments += added
        if added:
            log.warning(
                "OCM store: Redis at %s %s namespace %s; restored %d increments over %d patterns from this "
                "replica's view of %d patterns",
                self.url,
                "lost the history of" if loss == "lost" else "held fewer counts than this replica saw in",
                ns.key,
                added,
                raised,
                len(view),
            )
        else:
            log.info("OCM store: Redis at %s holds everything this replica saw of %s", self.url, ns.key)

    def _scan(self, key: str) -> tuple[dict[Pair, int], set[bytes]]:
        """The whole sorted set, read in slices so that no single command blocks Redis for long."""
        fields: list[bytes] = []
        values: list[bytes] = []
        cursor = 0
        while True:
            cursor, items = self._client.zscan(key, cursor, count=SCAN_SLICE, score_cast_func=bytes)
            for member, score in items:
                fields.append(member)
                values.append(score)
            if cursor == 0:
                break
        return self._parse(fields, values)  # ZSCAN may repeat a member: the dict keeps one

    @staticmethod
    def _parse(fields: Sequence, values: Sequence) -> tuple[dict[Pair, int], set[bytes]]:
        fresh: dict[Pair, int] = {}
        junk: set[bytes] = set()
        for f, v in zip(fields, values, strict=True):
            if v is None:  # stamped but gone (evicted or deleted): the next full reload drops it
                continue
            pattern, count = keys.parse_field(f), keys.parse_count(v)
            if pattern is None or count is None:
                junk.add(f if isinstance(f, bytes) else str(f).encode())
                continue
            fresh[pattern] = count
        return fresh, junk

    def _registry(self) -> list[tuple[str, Namespace | None]]:
        """(id, namespace) for each registered namespace; None for an entry that does not parse."""
        out = []
        for raw_id, raw_key in self._client.hgetall(keys.REGISTRY).items():
            nid = raw_id.decode("utf-8", "replace")
            try:
                ns = Namespace.from_key(raw_key.decode("utf-8"))
                if keys.namespace_id(ns) != nid:
                    raise ValueError("id does not match the key")
            except (UnicodeDecodeError, ValueError) as exc:
                log.warning("OCM store: skipped a malformed namespace registry entry %r (%s)", nid, exc)
                ns = None
            out.append((nid, ns))
        return out

    def _top_in_redis(self, namespace: Namespace, n: int) -> list[Pattern]:
        """The n largest counts as Redis holds them (junk entries skipped and logged)."""
        key = keys.keys_for(namespace).counts
        kind = self._client.type(key)
        if kind not in (b"zset", b"none"):
            raise redis.ResponseError(f"CSDWRONGTYPE {key} holds a {kind.decode()}, expected a zset")
        if n <= TOP_RANGE_MAX:  # one rank range, with room for a few junk entries at the top
            items = self._client.zrevrange(key, 0, n + 99, withscores=True, score_cast_func=bytes)
            counts, junk = self._parse([m for m, _ in items], [v for _, v in items])
        else:  # everything (an export): slices, not one huge reply
            counts, junk = self._scan(key)
        if junk:
            log.warning("OCM store: skipped %d malformed values in namespace %s", len(junk), namespace.key)
        best = heapq.nlargest(n, counts.items(), key=lambda kv: kv[1])
        return [Pattern(d, t, c) for (d, t), c in best]
