"""Continuous batching: the sequences being decoded share every target forward.

A `Batch` owns the running sequences and one `BatchKV` holding their caches (padding + masks; the layout is
explained there). Each `step()`:
1. feeds at most one prefill chunk of the oldest joining sequence into that sequence's own cache; a
   sequence whose prompt is in joins the running rows. A step's tokens (the previous round's width plus
   the chunk) stay within `max_batched_tokens`, and one chunk per step, so a long prompt delays the
   others' next round by one bounded chunk forward, never by its whole prefill;
2. runs one decoding round for every running row: each offers its draft, the draft policy picks one draft
   cap K for the batch (0 when speculation does not pay at this batch size and acceptance), one target
   forward verifies [last token, draft] of every row, and each row verifies, rescues (CSD) and emits on its
   own logits as if it ran alone;
3. drops the rows that finished.

Rows join and leave between steps (continuous batching); `remove()` takes out a cancelled sequence without
touching the others.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from service.decoding.batch_kv import BatchKV
from service.decoding.draft_policy import DraftPolicy
from service.decoding.drafters import Draft, ModelDraftRows
from service.decoding.engine import Generation
from service.decoding.models import LoadedModel
from service.decoding.types import DecodingError, GenerationStep

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCHED_TOKENS = 128
# A prefill chunk is never smaller than this, so a prompt goes in even beside a batch that fills the budget.
MIN_PREFILL_CHUNK = 16


class Batch:
    def __init__(
        self,
        target: LoadedModel,
        policy: DraftPolicy | None = None,
        max_batch_size: int = 1,
        max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
    ) -> None:
        if max_batch_size < 1:
            raise DecodingError("max_batch_size must be at least 1")
        if max_batched_tokens < max_batch_size:
            raise DecodingError("max_batched_tokens must be at least max_batch_size (one token per row)")
        self.target = target
        self.policy = policy or DraftPolicy()
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.kv = BatchKV(target.model, target.device)
        self.running: list[Generation] = []  # row b of self.kv is running[b]
        # sequences whose prompts are going in: (generation, its target cache, its draft-model cache or None)
        self.joining: collections.deque[tuple[Generation, BatchKV, BatchKV | None]] = collections.deque()
        # per draft model (by drafter name): the draft caches of the running sequences that use it
        self.draft_rows: dict[str, ModelDraftRows] = {}
        self._round_width = 0  # tokens the last decoding round fed (rows x (1 + draft cap))
        # sequences the last step took out because their own verification or emission raised: the others
        # in the batch carry on; whoever drives the batch reports these
        self.failed: list[tuple[Generation, Exception]] = []

    # ------------------------------------------------------------------ membership

    def __len__(self) -> int:
        return len(self.running) + len(self.joining)

    @property
    def has_room(self) -> bool:
        return len(self) < self.max_batch_size

    def add(self, generation: Generation) -> None:
        if not self.has_room:
            raise DecodingError(f"the batch is full ({self.max_batch_size} sequences)")
        if generation.target is not self.target:
            raise DecodingError("a batch runs sequences of one target model")
        draft_kv = None
        if generation.drafter_session is not None and not generation.drafter.cheap:
            rows = self.draft_rows.get(generation.drafter.name)
            if rows is None:
                rows = self.draft_rows[generation.drafter.name] = ModelDraftRows(generation.drafter.draft)
            draft_kv = rows.new_row()
        self.joining.append((generation, BatchKV(self.target.model, self.target.device, rows=1), draft_kv))

    def remove(self, generation: Generation) -> None:
        """Take a sequence out (cancelled or finished); the others carry on untouched."""
        for i, (joining, _, _) in enumerate(self.joining):
            if joining is generation:
                del self.joining[i]
                return
        self._drop_running([generation])

    def _drop_running(self, generations: list[Generation]) -> None:
        """Running sequences out, with one copy of the cache however many leave."""
        rows = [row for row, g in enumerate(self.running) if any(g is x for x in generations)]
        if not rows:
            return
        self.running = [g for row, g in enumerate(self.running) if row not in rows]
        self.kv.remove(rows)
        for generation in generations:
            for draft_rows in self.draft_rows.values():
                draft_rows.leave(generation)

    def clear(self) -> None:
        """Drop every sequence (after a failed forward the caches cannot be trusted)."""
        self.running.clear()
        self.joining.clear()
        self.kv = BatchKV(self.target.model, self.target.device)
        self.draft_rows.clear()

    # ------------------------------------------------------------------ one step

    def step(self) -> list[tuple[Generation, GenerationStep]]:
        """One prefill chunk (if a sequence is joining) and one decoding round (if any is running)."""
        self.failed = []
        with torch.inference_mode():
            self._prefill_chunk()
            if not self.running:
                return []
            return self._round()

    def _prefill_chunk(self) -> None:
        if not self.joining:
            return
        generation, own, draft_own = self.joining[0]
        size = self.max_batched_tokens
        if self.running:  # share the step's token budget with the running rows' round
            size = max(min(MIN_PREFILL_CHUNK, size), size - max(self._round_width, len(self.running)))
        chunk = generation.prefill_ids[generation.prefilled : generation.prefilled + size]
        if chunk:
            started = time.perf_counter()
            # logits_to_keep=1 skips the vocabulary projection of the prompt: only its cache is wanted
            own.forward([chunk], logits_to_keep=1)
            if draft_own is not None:
                draft_own.forward([chunk], logits_to_keep=1)
            generation.prefilled += len(chunk)
            generation.stats.prefill_seconds += time.perf_counter() - started
        if generation.prefilled >= len(generation.prefill_ids):
            self.joining.popleft()
            self.kv.add(own)
            self.running.append(generation)
            if draft_own is not None:
                self.draft_rows[generation.drafter.name].join(generation, draft_own, generation.prefill_ids)

    def _round(self) -> list[tuple[Generation, GenerationStep]]:
        started = time.perf_counter()
        rows = len(self.running)
        offers = [g.offer_draft() for g in self.running]
        cap = self.policy.choose_batch(
            [o for o in offers if o is not None], rows=rows, max_len=self.max_batched_tokens // rows - 1
        )
        drafts = self._drafts(offers, cap)
        feeds = [g.round_tokens(d) for g, d in zip(self.running, drafts, strict=True)]
        logits = self.kv.forward(feeds)
        self._round_width = rows * max(len(f) for f in feeds)
        seconds = time.perf_counter() - started
        results: list[tuple[Generation, GenerationStep]] = []
        for row, (generation, draft, fed) in enumerate(zip(self.running, drafts, feeds, strict=True)):
            try:
                step, kept = generation.absorb(draft, logits[row, : len(fed)].float(), seconds)
            except Exception as exc:  # one sequence's failure is its own: the batch goes on without it
                log.exception("a sequence failed in its verification; dropping it from the batch")
                self.failed.append((generation, exc))
                continue
            # the cache now holds the row's committed tokens but the last, plus everything fed this round
            self.kv.keep(row, self.kv.length(row) - len(fed) + kept)
            results.append((generation, step))
        self.kv.settle()
        done = [g for g, _ in self.failed] + [g for g in self.running if g.finish_reason is not None]
        self._drop_running(done)
        return results

    def _drafts(self, offers: list, cap: int) -> list[Draft]:
        """Each row's draft under the cap: cheap proposals cut to it; draft models run batched, one draft
        forward per position for all the rows that use them."""
        wanted: dict[str, dict] = {}
        for generation, offer in zip(self.running, offers, strict=True):
            if offer is not None and not generation.drafter.cheap:
                k = generation.draft_limit(cap)
                if k:
                    wanted.setdefault(generation.drafter.name, {})[generation] = (
                        generation.committed,
                        k,
                        generation.drafter_session,
                    )
        proposed: dict = {}
        for name, rows in wanted.items():
            proposed.update(self.draft_rows[name].propose(rows))
        drafts = []
        for generation, offer in zip(self.running, offers, strict=True):
            if offer is None:
                drafts.append(Draft([]))
            elif generation.drafter.cheap:
                drafts.append(generation.take_draft(cap))
            else:
                drafts.append(proposed.get(generation, Draft([])))
        return drafts
