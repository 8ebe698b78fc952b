"""Builds the heavy state once from `Settings`: models, drafters, the OCM store and the engine.

The CLI and the HTTP app both start from here, so a setting means the same thing everywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ocm_store.base import Namespace, OCMStore
from ocm_store.draft_pool import RedisDraftPool
from ocm_store.factory import open_store
from ocm_store.urls import open_client
from service.config import Settings
from service.cost_cache import cost_file, cost_key, load_costs, save_costs
from service.decoding import (
    DecodingError,
    Drafter,
    DraftPolicy,
    Engine,
    HeadDrafter,
    LoadedModel,
    check_same_vocabulary,
    load_model,
    vocabulary_hash,
)
from service.decoding.draft_head import EMBEDDED_HEAD_DIR
from service.decoding.drafter_registry import DrafterInputs, build_drafters, drafter_entry
from service.decoding.drafters.suffix import SuffixDrafter
from service.decoding.prefix_cache import PrefixCache, default_max_bytes, prefix_caching_unsupported
from service.executor.batch_kv import supports_batching
from service.executor.forward_costs import CostMeasurement
from service.executor.threads import (
    ThreadChoice,
    ThreadGovernor,
    choose_threads,
    install_governor,
    oversubscription,
)

log = logging.getLogger(__name__)


def apply_threads(requested: int | None) -> ThreadChoice:
    """Give torch the intra-op threads `requested`, else as many as the CPUs this process may use
    (`threads.choose_threads`: affinity mask and cgroup CPU quota, not the host's cores, less the CPUs other
    processes keep busy) and follow those while serving (`threads.ThreadGovernor`); log the choice, and warn
    when the threads will compete for CPUs (a descheduled thread stalls every barrier of a forward)."""
    choice = choose_threads(requested)
    torch.set_num_threads(choice.threads)
    log.info("%s", choice.describe())
    # an explicit count is the operator's: kept as given; the default follows the idle CPUs while serving
    install_governor(ThreadGovernor(choice, torch.set_num_threads) if requested is None else None)
    if reason := oversubscription(choice):
        log.warning(
            "CPU oversubscribed: %s; a forward waits for its slowest thread, so generation may slow down "
            "many times: give the process its own CPUs, or lower --torch-threads",
            reason,
        )
    return choice


@dataclass
class Runtime:
    settings: Settings
    target: LoadedModel
    engine: Engine
    store: OCMStore
    namespaces: dict[str, Namespace] = field(default_factory=dict)  # drafter name -> its model pair
    draft: LoadedModel | None = None
    # one more forward of a cost measurement that ran out of its start-up budget; False once it is done.
    # The engine worker calls it while it has nothing else to do (it owns the model's thread).
    refine_costs: Callable[[], bool] | None = None
    # the suffix drafter's outputs pooled across replicas (ocm_store/draft_pool.py), with a Redis URL
    draft_pool: RedisDraftPool | None = None

    @property
    def model_id(self) -> str:
        return self.settings.served_model_name or self.target.name

    @classmethod
    def build(cls, settings: Settings, store: OCMStore | None = None) -> Runtime:
        apply_threads(settings.torch_threads)
        target = load_model(
            settings.model,
            dtype=settings.dtype,
            device=settings.device,
            cache_dir=settings.cache_dir,
            pack_cpu_weights=settings.pack_cpu_weights,
            weights=settings.weights,
        )
        # say what `auto` chose: int4 weights for a 4-bit GGUF on the CPU; bf16 on a CPU with native bf16
        # matmuls, fp32 on one without
        log.info(
            "target %s in %s with %s weights on %s (--dtype %s, --weights %s)",
            target.identity,
            str(target.model.dtype).removeprefix("torch."),
            target.weights,
            target.device,
            settings.dtype,
            settings.weights,
        )
        draft = None
        if settings.draft_model:
            draft = load_model(
                settings.draft_model,
                dtype=settings.dtype,
                device=settings.device,
                cache_dir=settings.cache_dir,
                pack_cpu_weights=settings.pack_cpu_weights,
                weights=settings.weights,
            )
            check_same_vocabulary(target, draft)
        head = _load_head(settings, target)
        inputs = DrafterInputs(target, settings.ngram_min, settings.ngram_max, draft=draft, head=head)
        drafters = build_drafters(inputs)
        if settings.drafter not in drafters and drafter_entry(settings.drafter).needs == "draft_head":
            raise DecodingError(
                f"drafter {settings.drafter!r} needs a draft head trained for {settings.model!r} "
                "(--draft-head FOLDER; the embedded head serves the embedded model only)"
            )
        if store is None:
            store = open_store(
                settings.redis_url.get_secret_value() if settings.redis_url else None,
                settings.ocm_file,
                max_patterns=settings.ocm_max_patterns,
                save_interval_s=settings.ocm_save_interval_s,
                flush_interval_s=settings.ocm_flush_interval_s,
                refresh_interval_s=settings.ocm_refresh_interval_s,
                spill_dir=settings.ocm_spill_dir,
            )
        namespaces = ocm_namespaces(target, drafters)
        memories = {name: store.memory(ns) for name, ns in namespaces.items()}
        if settings.max_batch_size > 1 and not all(
            supports_batching(m.model) for m in (target, draft) if m is not None
        ):
            log.warning(
                "%s has sliding-window attention layers, which the batched KV layout cannot hold: serving "
                "one generation at a time (CSD_MAX_BATCH_SIZE=1)",
                settings.model,
            )
            settings = settings.model_copy(update={"max_batch_size": 1})
        policy, refine_costs = None, None
        if settings.adaptive_speculation and settings.num_speculative_tokens > 0:
            policy, refine_costs = _draft_policy(settings, target)
        engine = Engine(target, drafters, memories, policy, prefix_cache=_prefix_cache(settings, target))
        draft_pool = _draft_pool(settings, target, drafters.get("suffix"))
        return cls(settings, target, engine, store, namespaces, draft, refine_costs, draft_pool)

    def close(self) -> None:
        if self.draft_pool is not None:
            self.draft_pool.close()
        self.store.close()


def _draft_pool(settings: Settings, target: LoadedModel, suffix: Drafter | None) -> RedisDraftPool | None:
    """With a Redis URL, the suffix drafter's finished outputs go to the fleet's stream and the other
    replicas' come back into its trees (started here: the recent stream is read back in the background)."""
    if suffix is None or settings.redis_url is None:
        return None
    assert isinstance(suffix, SuffixDrafter)
    client = open_client(
        settings.redis_url.get_secret_value(),
        socket_connect_timeout=2,
        socket_timeout=5,
        client_name="csd-drafts",
    )
    namespace = f"{target.identity}|{vocabulary_hash(target.tokenizer)}"
    pool = RedisDraftPool(client, namespace, suffix.fold)
    suffix.pool_sink = pool.start()
    log.info("suffix drafts pooled across replicas through Redis, per %s", settings.draft_pool_scope)
    return pool


def _prefix_cache(settings: Settings, target: LoadedModel) -> PrefixCache | None:
    """The engine's prefix cache, or None when it is off or the model's cache cannot be shared (logged)."""
    if not settings.enable_prefix_caching:
        return None
    reason = prefix_caching_unsupported(target.model)
    if reason is not None:
        log.warning("prefix caching is off for %s: %s", settings.model, reason)
        return None
    if settings.prefix_cache_gib is not None:
        max_bytes = int(settings.prefix_cache_gib * (1 << 30))
    else:
        max_bytes = default_max_bytes(target.device)
    log.info("prefix caching on: up to %.2f GiB of KV blocks", max_bytes / (1 << 30))
    return PrefixCache(max_bytes)


# How long a start may spend measuring forward costs before it serves on what it has and measures the rest
# while idle. Measured on a quiet 2-core machine, 1 thread: ~2.4 s for one row of 7 sizes x 5 repeats.
START_MEASUREMENT_BUDGET_S = 3.0


def _draft_policy(settings: Settings, target: LoadedModel) -> tuple[DraftPolicy, Callable[[], bool] | None]:
    """The policy on the cached cost table, or on a fresh measurement (bounded; the rest in the
    background). Real batch shapes up to the largest batch: one row at every draft length, batches at
    doubling row counts."""
    max_tokens = settings.num_speculative_tokens + 1
    key = cost_key(target, max_tokens, settings.max_batch_size, settings.pack_cpu_weights)
    cached = load_costs(settings.cache_dir, key)
    if cached is not None:
        log.info(
            "target forward costs (ms) from the cache %s, rows x tokens: %s",
            cost_file(settings.cache_dir, key),
            cached.describe(max_tokens),
        )
        return DraftPolicy(cached), None
    started = time.monotonic()
    measurement = CostMeasurement(target.model, max_tokens, max_rows=settings.max_batch_size)
    measurement.run(budget_s=START_MEASUREMENT_BUDGET_S)
    # Not even the single row in time (a loaded machine): serve without a table, which verifies every
    # draft in full, until the background measurement has one.
    policy = DraftPolicy(measurement.table() if measurement.single_row_measured else None)
    log.info(
        "measured target forward costs for %.1f s (%d forwards%s), rows x tokens (ms): %s",
        time.monotonic() - started,
        measurement.forwards,
        "" if measurement.done else "; the rest while idle",
        policy.forward_costs.describe(max_tokens) if policy.forward_costs else "none yet",
    )

    def finish() -> None:
        costs = measurement.table()
        policy.set_costs(costs)
        if measurement.complete:
            save_costs(settings.cache_dir, key, costs)
        log.info(
            "forward costs complete (%d forwards), rows x tokens (ms): %s",
            measurement.forwards,
            costs.describe(max_tokens),
        )

    if measurement.done:
        finish()
        return policy, None

    def refine() -> bool:
        if measurement.measure_next():
            if policy.forward_costs is None and measurement.single_row_measured:
                policy.set_costs(measurement.table())  # one row is enough to start deciding
            return True
        finish()
        return False

    return policy, refine


def ocm_namespaces(target: LoadedModel, drafters: Mapping[str, Drafter]) -> dict[str, Namespace]:
    """Drafter name -> the OCM namespace of its (target, drafter) pair: the one place it is keyed, so the
    service, a reload and the benchmarks pool the same statistics."""
    vocab = vocabulary_hash(target.tokenizer)
    return {name: Namespace(target.identity, d.identity, vocab) for name, d in drafters.items()}


def _load_head(settings: Settings, target: LoadedModel) -> HeadDrafter | None:
    """The 'head' drafter: the shipped head when the target is the embedded model, or the folder given."""
    if not settings.draft_head:
        return None
    if settings.draft_head == "embedded":
        if not settings.embedded_head_applies:
            log.info(
                "the embedded draft head is for the embedded model only: no 'head' drafter for %s",
                settings.model,
            )
            return None
        folder = EMBEDDED_HEAD_DIR
    else:
        folder = Path(settings.draft_head)
    return HeadDrafter(target, folder)
