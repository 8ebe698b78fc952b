"""The store's side of the spill: what is still buffered when Redis is away at shutdown goes to
`spill_dir` with its batch ids, and the next store opened on that folder replays it before its own
increments. The file format is `ocm_store.spill`'s; this module decides what goes in and when the files go.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ocm_store.base import Namespace
from ocm_store.spill import SpilledBatch, read_spills, remove_spills, write_spill

# the store's one logger, named as before the split: log filters and tests select it by that name
log = logging.getLogger("ocm_store.redis_store")


class SpillMixin:
    """A part of `RedisStore` (ocm_store.redis_store): its state is set up in `RedisStore.__init__`."""

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
