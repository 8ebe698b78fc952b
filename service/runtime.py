"""Builds the heavy state once from `Settings`: models, drafters, the OCM store and the engine.

The CLI and the HTTP app both start from here, so a setting means the same thing everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ocm_store.base import Namespace, OCMStore
from ocm_store.factory import open_store
from service.config import Settings
from service.decoding import (
    CombinedDrafter,
    DecodingError,
    Drafter,
    DraftPolicy,
    Engine,
    HeadDrafter,
    LoadedModel,
    ModelDrafter,
    NgramDrafter,
    check_same_vocabulary,
    load_model,
    vocabulary_hash,
)
from service.decoding.batch_kv import supports_batching
from service.decoding.draft_head import EMBEDDED_HEAD_DIR
from service.decoding.draft_policy import measure_forward_costs

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: Settings
    target: LoadedModel
    engine: Engine
    store: OCMStore
    namespaces: dict[str, Namespace] = field(default_factory=dict)  # drafter name -> its model pair
    draft: LoadedModel | None = None

    @property
    def model_id(self) -> str:
        return self.settings.served_model_name or self.target.name

    @classmethod
    def build(cls, settings: Settings, store: OCMStore | None = None) -> Runtime:
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        target = load_model(
            settings.model,
            dtype=settings.dtype,
            device=settings.device,
            cache_dir=settings.cache_dir,
            pack_cpu_weights=settings.pack_cpu_weights,
        )
        drafters: dict[str, Drafter] = {"ngram": NgramDrafter(settings.ngram_min, settings.ngram_max)}
        draft = None
        if settings.draft_model:
            draft = load_model(
                settings.draft_model,
                dtype=settings.dtype,
                device=settings.device,
                cache_dir=settings.cache_dir,
                pack_cpu_weights=settings.pack_cpu_weights,
            )
            check_same_vocabulary(target, draft)
            drafters["model"] = ModelDrafter(draft)
        head = _load_head(settings, target)
        if head is not None:
            drafters["head"] = head
            drafters["combined"] = CombinedDrafter(drafters["ngram"], head)
        elif settings.drafter in ("head", "combined"):
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
            )
        vocab = vocabulary_hash(target.tokenizer)
        target_id = f"{target.name}@{target.revision}"
        namespaces = {name: Namespace(target_id, d.identity, vocab) for name, d in drafters.items()}
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
        policy = None
        if settings.adaptive_speculation and settings.num_speculative_tokens > 0:
            # Real batch shapes up to the largest batch: one row at every draft length, batches at doubling
            # row counts (a few seconds at start on a CPU).
            k = settings.num_speculative_tokens
            costs = measure_forward_costs(target.model, k + 1, max_rows=settings.max_batch_size)
            log.info(
                "target forward costs (ms), rows x tokens: %s",
                ", ".join(
                    f"{rows}x{t}: {costs(rows, t) * 1e3:.1f}"
                    for rows in costs.by_rows
                    for t in sorted({1, k + 1})
                ),
            )
            policy = DraftPolicy(costs)
        engine = Engine(target, drafters, memories, policy)
        return cls(settings, target, engine, store, namespaces, draft)

    def close(self) -> None:
        self.store.close()


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
