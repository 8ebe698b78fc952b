"""OCMs for the benchmark: a calibrated one (warmed exactly as `csd calibrate` does) and cold ones.

Every store here is an in-memory one, private to the run: the user's OCM file and any Redis are never touched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ocm_store.base import Namespace, OCMStore
from ocm_store.memory import InMemoryStore
from service.calibration import CalibrationResult, calibrate
from service.decoding import Drafter, DraftPolicy, Engine, LoadedModel
from service.runtime import ocm_namespaces


def namespaces(target: LoadedModel, drafters: Mapping[str, Drafter]) -> dict[str, Namespace]:
    """drafter name -> the model pair's namespace, keyed as the service keys it."""
    return ocm_namespaces(target, drafters)


def engine_with_store(
    target: LoadedModel, drafters: Mapping[str, Drafter], store: OCMStore, policy: DraftPolicy | None = None
) -> Engine:
    spaces = namespaces(target, drafters)
    return Engine(target, dict(drafters), {name: store.memory(ns) for name, ns in spaces.items()}, policy)


def copy_store(source: OCMStore) -> InMemoryStore:
    """An independent copy, so one experiment's online learning never leaks into another's."""
    copy = InMemoryStore()
    for ns in source.namespaces():
        copy.merge(ns, [(p.draft_token, p.target_token, p.count) for p in source.top(ns, 10**9)])
    return copy


def calibrated_store(
    target: LoadedModel,
    drafters: Mapping[str, Drafter],
    items: Sequence[Mapping],
    *,
    num_speculative_tokens: int,
    max_tokens: int,
    on_prompt: Callable[[CalibrationResult], None] | None = None,
) -> tuple[InMemoryStore, dict[str, CalibrationResult]]:
    """Strict SD with recording over the calibration prompts, once per drafter (patterns are per model pair)."""
    store = InMemoryStore()
    engine = engine_with_store(target, drafters, store)
    results = {
        name: calibrate(
            engine,
            items,
            drafter=name,
            num_speculative_tokens=num_speculative_tokens,
            max_tokens=max_tokens,
            on_prompt=on_prompt,
        )
        for name in drafters
    }
    return store, results


def top_patterns(store: OCMStore, namespace: Namespace, target: LoadedModel, n: int = 15) -> list[dict]:
    decode = target.tokenizer.decode
    return [
        {"draft": decode([p.draft_token]), "target": decode([p.target_token]), "count": p.count}
        for p in store.top(namespace, n)
    ]
