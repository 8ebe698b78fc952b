"""Continuous batching: the sequences being decoded share every target forward.

A `Batch` owns the running sequences and one `BatchKV` holding their caches (padding + masks; the layout is
explained there). Each `step()`:
1. feeds at most one prefill chunk of the oldest joining sequence into that sequence's own cache; a
   sequence whose prompt is in joins the running rows. A step's tokens (the previous round's width plus
   the chunk) stay within `max_batched_tokens`, and one chunk per step, so a long prompt delays the
   others' next round by one bounded chunk forward, never by its whole prefill;
2. runs one decoding round for every running row (`_round`, read top to bottom): every drafter proposes
   for its rows as far as the draft policy expects drafting to pay (`DraftPolicy.draft_length`: not at all
   when its drafts would rarely be verified), the draft policy picks the round's draft cap from the rows' own acceptance and the
   batch's forward cost (0 when speculation does not pay at this batch size), one target forward
   verifies [last token, draft] of every row, and each
   row verifies, rescues (CSD) and emits on its own logits as if it ran alone;
3. drops the rows that finished.

Rows join and leave between steps (continuous batching); `remove()` takes out a cancelled sequence without
touching the others.

Faults: where one can be told to be one sequence's (its prefill chunk, on its own cache; its draft; its
verification or emission, detokenising included), that sequence leaves the batch into `failed` and the
others go on. A fault of what the rows share (the batched forward, the batch's cache) raises from `step()`:
no row's cache can be trusted then, and whoever drives the batch clears it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import torch

from service.decoding.draft_policy import DraftPolicy, RowOffer
from service.decoding.drafters.base import BatchDrafter, Draft, DraftRow
from service.decoding.generation import Generation
from service.decoding.types import DecodingError, GenerationRound
from service.executor import threads
from service.executor.batch_kv import BatchKV
from service.executor.models import LoadedModel

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
        self.hidden = target.final_hidden  # installs the capture before the first forward
        self.running: list[Generation] = []  # row b of self.kv is running[b]
        # prompts going in, each with its own one-row target cache: a group of sequences that share the
        # prompt (a request's n choices) is prefilled once and joins as one row per sequence
        self.joining: collections.deque[tuple[list[Generation], BatchKV]] = collections.deque()
        # per drafter (by name): its state for this batch's sequences (draft caches, n-gram indexes)
        self.drafters: dict[str, BatchDrafter] = {}
        self._round_width = 0  # tokens the last decoding round fed (rows x (1 + draft cap))
        # ids of the sequences whose drafter explores this round (`DraftPolicy.draft_length`): their drafts
        # are verified in full
        self._exploring: set[int] = set()
        # sequences the last step took out because their own verification or emission raised: the others
        # in the batch carry on; whoever drives the batch reports these
        self.failed: list[tuple[Generation, Exception]] = []

    # ------------------------------------------------------------------ membership

    def __len__(self) -> int:
        return len(self.running) + sum(len(group) for group, _ in self.joining)

    @property
    def has_room(self) -> bool:
        return len(self) < self.max_batch_size

    def room(self) -> int:
        """How many more sequences fit."""
        return self.max_batch_size - len(self)

    def add(self, generation: Generation) -> None:
        self.add_group([generation])

    def add_group(self, generations: list[Generation]) -> None:
        """Sequences of one prompt (a request's choices): one prefill, then one row each."""
        if len(generations) > self.room():
            raise DecodingError(f"the batch is full ({self.max_batch_size} sequences)")
        if any(g.prompt_ids != generations[0].prompt_ids for g in generations):
            raise DecodingError("a group of sequences shares one prompt")
        for generation in generations:
            if generation.target is not self.target:
                raise DecodingError("a batch runs sequences of one target model")
            if generation.drafter is not None and generation.drafter.name not in self.drafters:
                self.drafters[generation.drafter.name] = generation.drafter.rows()
        self.joining.append((list(generations), BatchKV(self.target.model, self.target.device, rows=1)))

    def remove(self, generation: Generation) -> None:
        """Take a sequence out (cancelled or finished); the others carry on untouched."""
        for i, (group, _) in enumerate(self.joining):
            if any(g is generation for g in group):
                group[:] = [g for g in group if g is not generation]
                if not group:
                    del self.joining[i]
                drafter = self._drafter_of(generation)
                if drafter is not None:
                    drafter.leave(generation)
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
            drafter = self._drafter_of(generation)
            if drafter is not None:
                drafter.leave(generation)

    def _drafter_of(self, generation: Generation) -> BatchDrafter | None:
        """The batch's state of the generation's drafter (None when it does not speculate)."""
        return self.drafters.get(generation.drafter.name) if generation.drafter is not None else None

    def clear(self) -> None:
        """Drop every sequence (after a failed forward the caches cannot be trusted)."""
        self.running.clear()
        self.joining.clear()
        self.kv = BatchKV(self.target.model, self.target.device)
        self.drafters.clear()

    # ------------------------------------------------------------------ one step

    def step(self) -> list[tuple[Generation, GenerationRound]]:
        """One prefill chunk (if a sequence is joining) and one decoding round (if any is running)."""
        self.failed = []
        threads.tick()  # the model thread follows the idle CPUs (service/executor/threads.py)
        with torch.inference_mode():
            self._prefill_chunk()
            if not self.running:
                return []
            return self._round()

    def _prefill_chunk(self) -> None:
        if not self.joining:
            return
        group, own = self.joining[0]
        try:
            own, done = self._feed_chunk(group, own)
        except Exception as exc:  # the chunk ran on the group's own cache: the running rows never saw it
            log.exception("a prefill failed; dropping its sequences from the batch")
            self.joining.popleft()
            for generation in group:
                drafter = self._drafter_of(generation)
                if drafter is not None:
                    drafter.leave(generation)
                self.failed.append((generation, exc))
            return
        if done:
            self.joining.popleft()
            for _ in group[1:]:  # the other choices get copies of the one prefilled cache
                self.kv.add(own.copy())
            self.kv.add(own)
            # rows were added copies first: row order is the group's order either way (all copies are equal)
            self.running.extend(group)

    def _feed_chunk(self, group: list[Generation], own: BatchKV) -> tuple[BatchKV, bool]:
        """The joining group's next prompt chunk into its own cache `own` (and its drafters); (that cache,
        whether the prompt is all in)."""
        first = group[0]
        if first.prefilled == 0 and first.prefix_cache is not None:
            own = self._join_from_cache(group)
        size = self.max_batched_tokens
        if self.running:  # share the step's token budget with the running rows' round
            size = max(min(MIN_PREFILL_CHUNK, size), size - max(self._round_width, len(self.running)))
        chunk = first.prefill_ids[first.prefilled : first.prefilled + size]
        if chunk:
            started = time.perf_counter()
            # logits_to_keep=1 skips the vocabulary projection of the prompt: only its cache is wanted
            own.forward([chunk], logits_to_keep=1)
            hidden = self._final_hidden()[0, -1]
            for generation in group:
                generation.target_hidden = hidden
                drafter = self._drafter_of(generation)
                if drafter is not None:
                    drafter.prefill(generation, chunk)
                generation.prefilled += len(chunk)
            seconds = time.perf_counter() - started
            for generation in group:
                generation.stats.prefill_seconds += seconds
        done = first.prefilled >= len(first.prefill_ids)
        if done and first.prefix_cache is not None:
            self._store_prefill(first, own)
        return own, done

    # ------------------------------------------------------------------ prefix caching (prefix_cache.py)

    def _join_from_cache(self, group: list[Generation]) -> BatchKV:
        """A joining group's cached prompt prefix: its keys and values become the group's own cache at the
        same positions, so prefill feeds only the rest. At least one prompt token is still prefilled: its
        forward gives the hidden state the first draft starts from. The drafters see the cached tokens as
        prefill chunks (a draft model fills its own cache; the others keep nothing)."""
        first = group[0]
        cache = first.prefix_cache
        # the whole prompt is the query (vLLM's count); the hit stops short of the last prefill token
        hit = cache.lookup(first.prompt_ids, max_tokens=len(first.prefill_ids) - 1)
        own = BatchKV(self.target.model, self.target.device, rows=1)
        if hit.tokens:
            own.load_prefix(hit.keys, hit.values)
            cached = first.prefill_ids[: hit.tokens]
            for generation in group:
                drafter = self._drafter_of(generation)
                if drafter is not None:
                    for start in range(0, len(cached), self.max_batched_tokens):
                        drafter.prefill(generation, cached[start : start + self.max_batched_tokens])
                generation.prefilled = hit.tokens
        for generation in group:
            generation.stats.cached_tokens = hit.tokens
        self.joining[0] = (group, own)
        return own

    def _store_prefill(self, generation: Generation, own: BatchKV) -> None:
        """A finished prefill's full blocks into the prefix cache (`own` is one dense row: slot i holds
        prompt position i)."""
        tokens = generation.prefill_ids
        if tokens and own.width >= len(tokens):
            generation.prefix_cache.store(tokens, own.row_kv(0, len(tokens)))

    def _store_committed(self, generations: list[Generation]) -> None:
        """Finished sequences' committed tokens (prompt + output; the cache holds all but the last) into the
        prefix cache, so a conversation's next turn, which resends this answer, starts from it. Only live
        slots are read: rejected draft tokens are dead slots and never enter the cache."""
        for row, generation in enumerate(self.running):
            if generation.prefix_cache is None or not any(generation is g for g in generations):
                continue
            length = min(self.kv.length(row), len(generation.committed) - 1)
            if length >= generation.prefix_cache.block_size:
                try:
                    generation.prefix_cache.store(generation.committed[:length], self.kv.row_kv(row, length))
                except Exception:  # the answer is complete: a cache that cannot take it costs a later prefill
                    log.exception("could not store a finished sequence in the prefix cache")

    def _final_hidden(self) -> torch.Tensor:
        """The target's final hidden states of the forward that just ran, [B, T, d]."""
        hidden = self.hidden.latest
        assert hidden is not None
        return hidden

    def _round(self) -> list[tuple[Generation, GenerationRound]]:
        started = time.perf_counter()
        # 1. draft: every drafter proposes for its rows, up to each row's budget; a constrained row checks its
        # draft against its grammar (cut at a forbidden token, forced tokens drafted for free); every draft is
        # cut where nothing can follow (after an EOS, before a turn start). A row whose drafting raised
        # leaves the batch here, before the forward
        drafts = self._draft()
        rows = self.running
        if not rows:
            return []
        # 2. cap: the round's draft cap, from the rows' own acceptance and the batch's forward cost (0: plain)
        drafts = self._cap(rows, drafts)
        # 3. verify: one target forward over [last committed token, draft] of every row
        feeds = [g.round_tokens(d) for g, d in zip(rows, drafts, strict=True)]
        logits = self.kv.forward(feeds)
        hidden = self._final_hidden()
        self._round_width = len(rows) * max(len(f) for f in feeds)
        seconds = time.perf_counter() - started
        results: list[tuple[Generation, GenerationRound]] = []
        for row, (generation, draft, fed) in enumerate(zip(rows, drafts, feeds, strict=True)):
            try:
                # 4. verify: the row's own rule on its own logits keeps a prefix of its draft (CSD rescues here)
                verdict = generation.verify(draft, logits[row, : len(fed)].float())
                # 5. emit: EOS, stop strings and the budget may cut what it emits; the round is counted
                decoded = generation.emit(draft, verdict, seconds)
            except Exception as exc:  # one sequence's failure is its own: the batch goes on without it
                log.exception("a sequence failed in its verification; dropping it from the batch")
                self.failed.append((generation, exc))
                continue
            # 6. roll back: of the fed positions the cache keeps the last committed token's and the kept
            # draft tokens', and drops the rejected rest; the hidden state that chose the round's last token
            # is where the next draft starts
            cached = 1 + verdict.round.num_kept
            self.kv.keep(row, self.kv.length(row) - len(fed) + cached)
            generation.target_hidden = hidden[row, cached - 1].clone()
            results.append((generation, decoded))
        self.kv.settle()
        finished = [g for g in self.running if g.finish_reason is not None]
        self._store_committed(finished)
        self._drop_running([g for g, _ in self.failed] + finished)
        return results

    def _cap(self, rows: list[Generation], drafts: list[Draft]) -> list[Draft]:
        """Cut every row's draft to its cap from the draft policy (`DraftPolicy.choose_rows`); a row whose
        drafter explores this round keeps its whole draft (within the batch's token limit)."""
        max_len = self.max_batched_tokens // len(rows) - 1
        exploring = [i for i, d in enumerate(drafts) if d.tokens and id(rows[i]) in self._exploring]
        speculating = [i for i, d in enumerate(drafts) if d.tokens and id(rows[i]) not in self._exploring]
        offers = [
            RowOffer(rows[i].drafter.name, drafts[i].key, len(drafts[i].tokens), rows[i].acceptance)
            for i in speculating
        ]
        caps = self.policy.choose_rows(offers, rows=len(rows), max_len=max_len)
        drafts = list(drafts)
        for i, cap in [*zip(speculating, caps, strict=True), *((i, max_len) for i in exploring)]:
            drafts[i] = drafts[i].cut(cap)
        return drafts

    def _draft(self) -> list[Draft]:
        """Each running row's draft, checked against its grammar. A row whose draft raised (its drafter, its
        grammar) is taken out of the batch into `failed`; the drafts of the rows left are returned, in order."""
        failed: dict[int, Exception] = {}  # row -> what it raised
        drafts = self._propose(failed)
        for row, generation in enumerate(self.running):
            if row not in failed:
                try:
                    drafts[row] = generation.admissible(generation.constrain(drafts[row]))
                except Exception as exc:
                    failed[row] = exc
        if not failed:
            return drafts
        for exc in failed.values():
            log.error("a sequence failed to draft; dropping it from the batch", exc_info=exc)
        self.failed.extend((self.running[row], exc) for row, exc in failed.items())
        self._drop_running([self.running[row] for row in failed])
        return [draft for row, draft in enumerate(drafts) if row not in failed]

    def _propose(self, failed: dict[int, Exception]) -> list[Draft]:
        """Each running row's draft (empty when it does not speculate): one `propose` per drafter for all
        of its rows, as far as the draft policy expects drafting to pay (its time is measured for the
        policy). A row whose proposal raised is added to `failed`, with an empty draft."""
        drafts = [Draft([]) for _ in self.running]
        by_drafter: dict[str, list[int]] = {}
        requests = [g.draft_row() for g in self.running]
        self._exploring.clear()
        for index, (generation, request) in enumerate(zip(self.running, requests, strict=True)):
            if request is not None:
                by_drafter.setdefault(generation.drafter.name, []).append(index)
        for name, indexes in by_drafter.items():
            budget = max(requests[i].max_tokens for i in indexes)  # type: ignore[union-attr]
            length, explore = self.policy.draft_length(name, len(indexes), len(self.running), budget)
            if explore:
                self._exploring.update(id(self.running[i]) for i in indexes)
            # the policy's length bounds what costs: the positions a model drafts. A lookup drafts anyway (it
            # costs nothing), so `combined` keeps its prompt-lookup drafts whole where the head sits out
            for i in indexes:
                request = requests[i]
                assert request is not None
                requests[i] = dataclasses.replace(request, model_tokens=length)
            started = time.perf_counter()
            try:
                proposed = self.drafters[name].propose([requests[i] for i in indexes])
                if length > 0:  # what a drafted position costs is learnt from the rounds that paid for some
                    self.policy.observe_drafting(
                        name,
                        time.perf_counter() - started,
                        [d.key if d.tokens else None for d in proposed],
                        min(length, max((len(d.tokens) for d in proposed), default=0)),
                    )
            except Exception as exc:
                log.warning(
                    "drafter %r failed for %d row(s) (%r); asking each row alone", name, len(indexes), exc
                )
                proposed = self._propose_alone(name, indexes, requests, failed)
            for i, draft in zip(indexes, proposed, strict=True):
                drafts[i] = draft
        return drafts

    def _propose_alone(
        self, name: str, indexes: list[int], requests: list[DraftRow | None], failed: dict[int, Exception]
    ) -> list[Draft]:
        """After a drafter raised for several rows: which of them raised? One `propose` per row tells, and
        only those fail (falling back to no draft instead would hide a drafter's bug behind a lower
        acceptance). The call that raised may have left the drafter's state half updated, so it starts
        afresh: every drafter rebuilds it from each row's `committed` (drafters/base.py), a draft model by
        feeding each row's whole sequence once."""
        generation = self.running[indexes[0]]
        assert generation.drafter is not None
        self.drafters[name] = fresh = generation.drafter.rows()
        drafts: list[Draft] = []
        for i in indexes:
            try:
                drafts.extend(fresh.propose([requests[i]]))
            except Exception as exc:
                failed[i] = exc
                drafts.append(Draft([]))
        return drafts
