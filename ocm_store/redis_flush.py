"""The store's write side: the buffers sent to Redis as batches through the FLUSH script, one pipelined
round trip per round.

Each batch carries (writer id, batch number) and stays in flight until Redis confirms it, so a retry after a
lost reply never counts twice; the script's answer (the new absolute counts) replaces the snapshot entries.
"""

from __future__ import annotations

import logging
import secrets
import time

from ocm_store import keys
from ocm_store.base import Namespace
from ocm_store.redis_local import BATCH_PATTERNS, Pair, _Local

# the store's one logger, named as before the split: log filters and tests select it by that name
log = logging.getLogger("ocm_store.redis_store")


class FlushMixin:
    """A part of `RedisStore` (ocm_store.redis_store): its state is set up in `RedisStore.__init__`."""

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
