"""The store's read side: pulling what other replicas wrote (incrementally, or the whole set after an
eviction, a reset or a loss), restoring a history Redis lost from this replica's view, and the whole-set
reads behind them (`top`, the namespace registry).

A restore lives beside the refresh because the refresh is what finds the loss (see `redis_scripts` for why
a restore never counts twice, however many replicas restore at once).
"""

from __future__ import annotations

import heapq
import logging
import secrets
from collections.abc import Sequence

import redis

from ocm_store import keys
from ocm_store.base import Namespace, Pattern
from ocm_store.redis_local import BATCH_PATTERNS, Pair, _Local

# the store's one logger, named as before the split: log filters and tests select it by that name
log = logging.getLogger("ocm_store.redis_store")

TOP_RANGE_MAX = 10_000  # top(n) up to this n reads one rank range; beyond, the whole set in slices
SCAN_SLICE = 5000  # members per ZSCAN call of a full reload
MAX_DELTA = 20_000  # more changed patterns than this since the last refresh: read the whole set instead
MAX_JUNK_TRACKED = 1000  # junk fields remembered per namespace (for status and to log each once)


class RefreshMixin:
    """A part of `RedisStore` (ocm_store.redis_store): its state is set up in `RedisStore.__init__`."""

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
