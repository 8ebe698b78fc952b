"""Reload the draft head without a restart (POST /v1/admin/reload_drafter, or SIGHUP).

1. load the new head off the engine thread and check it against the target: `HeadDrafter`'s constructor
   refuses another vocabulary (hash) or hidden size; any error leaves the old head serving;
2. swap it between two engine rounds (`EngineWorker.between_rounds`): the running `HeadDrafter` takes the
   new weights in place, so the `head` and `combined` drafters and every generation in flight draft with it
   from the next round on; nothing in flight is dropped;
3. the OCM namespaces of `head` and `combined` follow the new identity (a divergence pattern belongs to
   one model pair): a new head starts a fresh namespace, for generations in flight too (their memory handle is
   rebound in the swap), so counts learned for the retired head never steer the new one. Only an explicit
   `carry_ocm` copies the retired head's counts into the new namespace (after the swap, off the engine
   thread): for a head fine-tuned from the old one that still makes its mistakes. A reload of the same
   weights is the same pair and keeps its namespace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ocm_store.base import Namespace, NamespacedMemory, OCMStore
from service.api.errors import APIError
from service.api.worker import EngineWorker
from service.decoding import DecodingError, HeadDrafter
from service.decoding.draft_head import EMBEDDED_HEAD_DIR
from service.decoding.drafter_registry import DRAFTERS
from service.runtime import Runtime, ocm_namespaces

log = logging.getLogger(__name__)

# Drafters that draft with the head (those the registry builds from it): their OCM namespaces follow a reload.
HEAD_DRAFTERS = tuple(entry.name for entry in DRAFTERS if entry.needs == "draft_head")


@dataclass
class HeadReloads:
    """Counts of reloads, by outcome, for /metrics."""

    outcomes: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one reload at a time


def configured_head_folder(runtime: Runtime) -> Path | None:
    """The folder the server loaded its head from (what a reload without a folder reads again)."""
    head = runtime.engine.drafters.get("head")
    if isinstance(head, HeadDrafter):
        return head.folder
    draft_head = runtime.settings.draft_head
    if draft_head == "embedded":
        return EMBEDDED_HEAD_DIR
    return Path(draft_head) if draft_head else None


def _swap(runtime: Runtime, new: HeadDrafter) -> tuple[str, list[tuple[Namespace, Namespace]]]:
    """On the engine thread, between rounds. Returns the new identity and the (retired, new) namespace
    pairs that changed."""
    running = runtime.engine.drafters["head"]
    assert isinstance(running, HeadDrafter)
    running.take_weights(new)
    drafters = {n: runtime.engine.drafters[n] for n in HEAD_DRAFTERS if n in runtime.engine.drafters}
    for name in drafters:  # another head's acceptance and cost say nothing of this one's: learn them afresh
        runtime.engine.policy.forget(name)
    changed = []
    for name, namespace in ocm_namespaces(runtime.target, drafters).items():
        retired = runtime.namespaces.get(name)
        if retired is not None and retired != namespace:
            changed.append((retired, namespace))
        runtime.namespaces[name] = namespace
        memory = runtime.engine.memories.get(name)
        if isinstance(memory, NamespacedMemory) and memory.store is runtime.store:
            memory.rebind(namespace)  # generations in flight hold this handle
        else:
            runtime.engine.memories[name] = runtime.store.memory(namespace)
    return running.identity, changed


def _carry(store: OCMStore, changed: list[tuple[Namespace, Namespace]]) -> int:
    """Copy each retired namespace's counts into its successor; returns the patterns copied."""
    copied = 0
    for retired, namespace in changed:
        rows = [(p.draft_token, p.target_token, p.count) for p in store.top(retired, 10**9)]
        store.merge(namespace, rows)
        copied += len(rows)
    return copied


async def reload_head(
    runtime: Runtime,
    worker: EngineWorker,
    folder: Path | None,
    reloads: HeadReloads,
    carry_ocm: bool = False,
) -> dict:
    running = runtime.engine.drafters.get("head")
    if not isinstance(running, HeadDrafter):
        raise APIError(
            409,
            "this server runs no 'head' drafter (start it with one: --draft-head), so there is none to reload",
            code="no_head_drafter",
        )
    folder = folder or configured_head_folder(runtime)
    assert folder is not None
    async with reloads.lock:
        started = time.monotonic()
        previous = running.identity
        try:
            if not folder.is_dir():
                raise DecodingError(f"{str(folder)!r} is not a folder")
            # loading reads the target's embeddings only: safe beside the engine thread's forwards
            new = await asyncio.to_thread(lambda: HeadDrafter(runtime.target, folder, reload=True))
        except Exception as exc:
            reloads.outcomes["failed"] += 1
            reason = str(exc) if isinstance(exc, DecodingError) else f"{type(exc).__name__}: {exc}"
            log.error("draft head reload from %s refused: %s; %s keeps serving", folder, reason, previous)
            raise APIError(
                400,
                f"the draft head in {str(folder)!r} cannot be loaded ({reason}); the running head "
                f"({previous}) keeps serving",
                param="folder",
                code="invalid_draft_head",
            ) from None
        identity, changed = await asyncio.wrap_future(worker.between_rounds(lambda: _swap(runtime, new)))
        carried = await asyncio.to_thread(_carry, runtime.store, changed) if carry_ocm else 0
        reloads.outcomes["ok"] += 1
        log.info(
            "draft head reloaded from %s: %s -> %s; OCM: %s",
            folder,
            previous,
            identity,
            f"{carried} patterns carried over"
            if carry_ocm
            else "fresh namespace"
            if changed
            else "same pair",
        )
        return {
            "object": "drafter.reload",
            "drafter": "head",
            "folder": str(folder),
            "previous_identity": previous,
            "identity": identity,
            "ocm_namespaces": [namespace.key for _, namespace in changed],
            "ocm_patterns_carried": carried,
            "seconds": round(time.monotonic() - started, 3),
        }


class HeadCollector(Collector):
    """The head in use (its identity: folder@weights hash) and the reloads, at scrape time."""

    def __init__(self, runtime_fn, reloads: HeadReloads, model_name: str = "unknown") -> None:
        self.runtime_fn = runtime_fn
        self.reloads = reloads
        self.model_name = model_name

    def describe(self) -> list:
        return []

    def collect(self):
        runtime: Runtime | None = self.runtime_fn()
        head = runtime.engine.drafters.get("head") if runtime is not None else None
        if not isinstance(head, HeadDrafter):
            return
        info = GaugeMetricFamily(
            "csd_draft_head_info", "The draft head in use (1)", labels=["model_name", "identity"]
        )
        info.add_metric([self.model_name, head.identity], 1.0)
        yield info
        reloads = CounterMetricFamily(
            "csd_draft_head_reloads", "Draft head reloads, by outcome", labels=["model_name", "outcome"]
        )
        for outcome, count in self.reloads.outcomes.items():
            reloads.add_metric([self.model_name, outcome], count)
        yield reloads
