"""The Redis key schema of the shared OCM: the one place key names and value formats are defined.

Everything lives under `PREFIX` (versioned: a change of layout gets a new version, never a silent reuse of
old keys). Per model pair (`Namespace`), with `{id}` = the first 16 hex digits of sha256(namespace.key):

    csd:ocm:v1:{id}            zset    "draft:target" scored by count  the divergence-pattern counts
    csd:ocm:v1:{id}:changes    zset    "draft:target" -> seq           seq of the last flush that touched it
    csd:ocm:v1:{id}:meta       hash    gen, seq, epoch, floor           change tracking (see redis_scripts)
    csd:ocm:v1:{id}:writers    hash    writer id -> last batch number   makes a retried flush idempotent
    csd:ocm:v1:{id}:restored   zset    "draft:target" -> count          restore bases after a data loss
    csd:ocm:v1:namespaces      hash    id -> namespace.key              registry: `namespaces()` without SCAN

The `{id}` braces are a Redis Cluster hash tag: one namespace's keys share a slot, so each Lua script only
touches keys of one slot. Nothing outside `PREFIX` is ever read or written (the tests run the store as an
ACL user limited to `~csd:ocm:v1:*`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ocm_store.base import Namespace

PREFIX = "csd:ocm:v1"
REGISTRY = f"{PREFIX}:namespaces"


def namespace_id(namespace: Namespace) -> str:
    """A short stable id for a namespace (its key can hold any characters; the id is safe in a key name)."""
    return hashlib.sha256(namespace.key.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class NamespaceKeys:
    id: str
    counts: str
    changes: str
    meta: str
    writers: str
    restored: str

    @property
    def all(self) -> list[str]:
        """In the order the Lua scripts take them as KEYS."""
        return [self.counts, self.changes, self.meta, self.writers, self.restored]


def keys_for(namespace: Namespace) -> NamespaceKeys:
    return keys_for_id(namespace_id(namespace))


def keys_for_id(nid: str) -> NamespaceKeys:
    base = f"{PREFIX}:{{{nid}}}"
    return NamespaceKeys(nid, base, f"{base}:changes", f"{base}:meta", f"{base}:writers", f"{base}:restored")


def pattern_field(draft_token: int, target_token: int) -> str:
    return f"{draft_token}:{target_token}"


def parse_field(field: bytes | str) -> tuple[int, int] | None:
    """'draft:target' -> (draft, target); None for anything else (junk written by someone else)."""
    try:
        text = field.decode("ascii") if isinstance(field, bytes) else field
    except UnicodeDecodeError:
        return None
    draft, sep, target = text.partition(":")
    if not (sep and _is_digits(draft) and _is_digits(target)):
        return None
    return int(draft), int(target)


def parse_count(value: bytes | str | int | None) -> int | None:
    """A stored count (a sorted-set score as Redis prints it: "7"); None for junk ("2.5", "-3", "inf")."""
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return int(value) if isinstance(value, str) and _is_digits(value) else None


def _is_digits(text: str) -> bool:
    # str.isdigit() alone accepts non-ASCII digits such as "²"; int() alone accepts " 7" and "1_000".
    return text.isascii() and text.isdigit()
