"""Draft statistics pooled across replicas: the suffix drafter's finished outputs, through Redis.

What one replica serves improves the others' drafts (issue 34). Each replica publishes every finished output
of the suffix drafter to one capped Redis stream per model pair, and folds the others' entries into its own
global suffix trees (`SuffixDrafter.fold`):

    csd:drafts:v1:{id}    stream    fields p (draft pool: the tenant), t (token ids, uint32 little-endian),
                                    r (the replica that served it)      XADD MAXLEN ~ max_len

with `{id}` = the first 16 hex digits of sha256(namespace), the namespace naming the target and its
vocabulary (token ids mean nothing across vocabularies); the braces are a Cluster hash tag. Why a stream and
not a shared tree: a tree in Redis would cost a round trip per draft on the hot path, where a stream costs one
XADD per finished request off it, and each replica drafts from memory; a stream also keeps the order that
eviction (oldest first) needs, and its cap bounds what Redis holds.

- Restart: a new replica reads the stream's last `read_back` entries back before it follows new ones, so a
  replica that comes back (or a fresh one) starts from what the fleet served recently.
- Tenants: an entry carries its pool, and a replica folds it into that pool's tree only; nothing here
  decides which requests share a pool (the API does: the API key's tenant by default).
- Redis away: publishing never blocks or raises (a bounded queue, drained by a writer thread; entries that
  cannot be sent while Redis is down are dropped), and the reader retries with a backoff. The drafter keeps
  drafting from what it has: local-only until Redis is back.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

PREFIX = "csd:drafts:v1"


def stream_key(namespace: str) -> str:
    return f"{PREFIX}:{{{hashlib.sha256(namespace.encode('utf-8')).hexdigest()[:16]}}}"


def pack_tokens(tokens: Sequence[int]) -> bytes:
    packed = array.array("I", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    packed = array.array("I")
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


class RedisDraftPool:
    """One replica's side of the pool: `publish` from the engine thread, a writer and a reader thread."""

    def __init__(
        self,
        client,  # redis.Redis or RedisCluster (ocm_store.urls.open_client)
        namespace: str,
        fold: Callable[[str, list[int]], None],
        *,
        max_len: int = 10_000,
        read_back: int = 2_000,
        block_ms: int = 500,
        queue_size: int = 1_000,
        replica: str | None = None,
    ) -> None:
        self.client = client
        self.key = stream_key(namespace)
        self.fold = fold
        self.max_len = max_len
        self.read_back = read_back
        self.block_ms = block_ms
        self.replica = replica or uuid.uuid4().hex[:12]
        self._outbox: queue.Queue[tuple[str, bytes] | None] = queue.Queue(queue_size)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.published = 0  # entries written to the stream
        self.folded = 0  # other replicas' entries folded in
        self.dropped = 0  # outputs not sent (the queue was full or Redis was away)
        self.caught_up = threading.Event()  # the read-back at start is done

    # ------------------------------------------------------------------ any thread

    def publish(self, pool: str, tokens: Sequence[int]) -> None:
        try:
            self._outbox.put_nowait((pool, pack_tokens(tokens)))
        except queue.Full:
            self.dropped += 1

    def start(self) -> RedisDraftPool:
        for target, name in ((self._write, "draft-pool-writer"), (self._read, "draft-pool-reader")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop both threads; what is still queued gets `timeout` to reach Redis."""
        self._stop.set()
        with contextlib.suppress(queue.Full):  # a full queue: the writer is a daemon, the join times out
            self._outbox.put_nowait(None)
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []

    # ------------------------------------------------------------------ the writer

    def _write(self) -> None:
        down_since: float | None = None
        while True:
            item = self._outbox.get()
            if item is None:
                return
            pool, packed = item
            try:
                self.client.xadd(
                    self.key,
                    {"p": pool, "t": packed, "r": self.replica},
                    maxlen=self.max_len,
                    approximate=True,
                )
                self.published += 1
                if down_since is not None:
                    log.info("draft pool: Redis is back; publishing again")
                    down_since = None
            except Exception as exc:  # Redis away: this output stays local, the next one tries again
                self.dropped += 1
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("draft pool: cannot publish to Redis (%s); drafting from local outputs", exc)

    # ------------------------------------------------------------------ the reader

    def _read(self) -> None:
        last: bytes | str | None = None  # the id of the last entry seen
        backoff = 0.1
        warned = False
        while not self._stop.is_set():
            try:
                if last is None:
                    last = self._read_back()
                    self.caught_up.set()
                reply = self.client.xread({self.key: last}, count=500, block=self.block_ms)
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        self._fold(fields)
                        last = entry_id
                backoff = 0.1
                if warned:
                    log.info("draft pool: reading from Redis again")
                    warned = False
            except Exception as exc:
                if not warned:
                    log.warning("draft pool: cannot read from Redis (%s); retrying with a backoff", exc)
                    warned = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _read_back(self) -> bytes | str:
        """The stream's last `read_back` entries, oldest first, folded in; the id to follow from."""
        entries = self.client.xrevrange(self.key, count=max(1, self.read_back))
        if self.read_back:
            for _, fields in reversed(entries):
                self._fold(fields)
        return entries[0][0] if entries else "0-0"

    def _fold(self, fields: dict) -> None:
        replica = fields.get(b"r", fields.get("r"))
        if isinstance(replica, bytes):
            replica = replica.decode()
        if replica == self.replica:  # this replica folded it when it finished
            return
        pool = fields.get(b"p", fields.get("p"))
        packed = fields.get(b"t", fields.get("t"))
        if pool is None or packed is None:
            return
        if isinstance(pool, bytes):
            pool = pool.decode("utf-8", "replace")
        try:
            self.fold(pool, unpack_tokens(packed))
            self.folded += 1
        except Exception:  # a malformed entry must not stop the reader
            log.exception("draft pool: could not fold an entry")
