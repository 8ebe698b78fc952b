"""Online Correction Memory stores: where CSD's divergence-pattern counts live."""

from ocm_store.base import (
    Namespace,
    NamespacedMemory,
    OCMStore,
    OCMStoreError,
    Pattern,
    StoreStatus,
    StoreUnavailableError,
)
from ocm_store.memory import InMemoryStore

__all__ = [
    "InMemoryStore",
    "Namespace",
    "NamespacedMemory",
    "OCMStore",
    "OCMStoreError",
    "Pattern",
    "StoreStatus",
    "StoreUnavailableError",
]
