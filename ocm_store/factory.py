"""Choose and open the OCM store the settings ask for."""

from __future__ import annotations

from pathlib import Path

from ocm_store.base import OCMStore
from ocm_store.memory import InMemoryStore


def open_store(
    redis_url: str | None,
    path: Path | None,
    *,
    max_patterns: int = 200_000,
    save_interval_s: float = 30.0,
    flush_interval_s: float = 0.1,
    refresh_interval_s: float = 0.5,
    spill_dir: Path | None = None,
) -> OCMStore:
    """Redis when a URL is given (shared by every replica; what cannot reach it at shutdown is spilled to
    `spill_dir` and replayed by the next start), else the in-process store persisted to `path`."""
    if redis_url:
        from ocm_store.redis_store import RedisStore  # redis-py is only needed with a URL

        return RedisStore(
            redis_url,
            max_patterns=max_patterns,
            flush_interval_s=flush_interval_s,
            refresh_interval_s=refresh_interval_s,
            spill_dir=spill_dir,
        )
    return InMemoryStore(path=path, save_interval_s=save_interval_s, max_patterns=max_patterns)
