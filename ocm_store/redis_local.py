"""What a `RedisStore` holds in process memory for one namespace, between the hot path and Redis.

`counts()` answers from this alone (snapshot + in flight + buffer + spilled batches not yet replayed), which
is what keeps the hot path off the network; every other module of the store reads or moves these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ocm_store import keys
from ocm_store.spill import SpilledBatch

BATCH_PATTERNS = 5000  # patterns per script call: bounds one call's time on the server

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
