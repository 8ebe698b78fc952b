"""The Online Correction Memory (OCM) store interface.

The OCM counts divergence patterns: (draft token id, target token id) pairs seen at rejections. Token ids
are only comparable within one vocabulary and one model pair, so every pattern lives in a `Namespace`.
The decoding core sees a store only through `store.memory(namespace)`, which has the two calls CSD needs
(`record`, `counts`); everything else here is for the service and the `csd ocm` tools.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Namespace:
    """One model pair: target (id + revision), drafter (draft model id, or "ngram"), vocabulary hash."""

    target: str
    drafter: str
    vocab: str

    @property
    def key(self) -> str:
        return f"{self.target}|{self.drafter}|{self.vocab}"

    @classmethod
    def from_key(cls, key: str) -> Namespace:
        target, drafter, vocab = key.rsplit("|", 2)
        return cls(target, drafter, vocab)


class OCMStoreError(Exception):
    """A store failure a user should see as one line (never carries credentials)."""


class StoreUnavailableError(OCMStoreError):
    """The shared store cannot be reached for an operation that needs it (reset, an import)."""


@dataclass(frozen=True)
class Pattern:
    draft_token: int
    target_token: int
    count: int


@dataclass
class StoreStatus:
    backend: str  # "memory" or "redis"
    healthy: bool  # False: degraded (for example Redis unreachable; decoding goes on with a local view)
    patterns: int  # distinct patterns over all namespaces (as far as this process knows)
    detail: str = ""
    extra: dict = field(default_factory=dict)


class OCMStore(abc.ABC):
    """A store of divergence-pattern counts, namespaced per model pair. Implementations are thread-safe."""

    backend: str = "abstract"

    @abc.abstractmethod
    def record(self, namespace: Namespace, patterns: Sequence[tuple[int, int]]) -> None:
        """Add one to the count of each (draft, target) pattern (a pattern may repeat in the batch)."""

    @abc.abstractmethod
    def counts(self, namespace: Namespace, patterns: Sequence[tuple[int, int]]) -> list[int]:
        """The current counts of these patterns (0 for unseen). Must not wait on a network."""

    @abc.abstractmethod
    def top(self, namespace: Namespace, n: int = 20) -> list[Pattern]:
        """The n most frequent patterns, most frequent first."""

    @abc.abstractmethod
    def merge(self, namespace: Namespace, items: Sequence[tuple[int, int, int]]) -> None:
        """Add (draft, target, count) rows, e.g. from an export of another store."""

    @abc.abstractmethod
    def namespaces(self) -> list[Namespace]: ...

    @abc.abstractmethod
    def reset(self, namespace: Namespace | None = None) -> None:
        """Forget one namespace, or everything."""

    @abc.abstractmethod
    def status(self) -> StoreStatus: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush what is buffered and release resources."""

    def reachable(self) -> bool:
        """Whether the storage behind the store can be reached now (False: a shared store is away and this
        process works on its local view). Tools that read or change the shared counts check it first."""
        return True

    def memory(self, namespace: Namespace) -> NamespacedMemory:
        return NamespacedMemory(self, namespace)


class NamespacedMemory:
    """A store bound to one model pair: the `CorrectionMemory` the decoding core uses."""

    def __init__(self, store: OCMStore, namespace: Namespace) -> None:
        self.store = store
        self.namespace = namespace

    def rebind(self, namespace: Namespace) -> None:
        """Count for another model pair from now on: a reloaded draft head is a new pair, and generations in
        flight, which hold this object, record its divergences under the new pair's namespace."""
        self.namespace = namespace

    def record(self, patterns: Sequence[tuple[int, int]]) -> None:
        self.store.record(self.namespace, patterns)

    def counts(self, patterns: Sequence[tuple[int, int]]) -> list[int]:
        return self.store.counts(self.namespace, patterns)
