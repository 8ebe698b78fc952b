"""A draft model: any causal LM sharing the target's vocabulary (a small model of the target's family).

Its KV cache lives in `ModelDraftRows`, one per batch, which drafts for every row of the batch in one
draft forward per draft position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.decoding.drafters.base import Draft, DraftRow
from service.decoding.verification import sampling_probs
from service.executor.batch_kv import BatchKV
from service.executor.models import LoadedModel


class ModelDrafter:
    name = "model"

    def __init__(self, draft: LoadedModel) -> None:
        self.draft = draft

    @property
    def identity(self) -> str:
        return self.draft.identity

    def rows(self) -> ModelDraftRows:
        return ModelDraftRows(self.draft)


class ModelDraftRows:
    """The draft model's KV cache for the sequences of one batch, one row each.

    Per round, `propose()` runs 1 + (k - 1) draft forwards for all rows together:
    1. catch-up: each row rolls its cache back to the longest prefix the target kept (the rejected draft
       tokens become dead slots) and feeds the committed tokens it has not seen (usually the last one or two);
    2. each further position feeds every row the token it just drafted.
    Rows that draft fewer tokens (their budget is nearly spent), or sit the round out, feed a dummy token
    that is dropped at once, so every row takes part in every forward. A joining sequence's prompt is
    prefilled into a one-row cache of its own, chunk by chunk, and joins the batch's cache at its first
    proposal.

    Every row drafts up to its `max_tokens`; the batch's draft policy may then verify fewer (its cap comes
    after the proposals, since an n-gram drafter's confidence is only known from its proposal). Where draft
    forwards are expensive against the target's, the policy's cap settles at what pays within a few rounds.
    """

    def __init__(self, draft: LoadedModel) -> None:
        self.draft = draft
        self.kv = BatchKV(draft.model, draft.device)
        self.keys: list[object] = []  # row -> the sequence it drafts for
        self.cached: list[list[int]] = []  # row -> token ids whose keys/values are live in self.kv
        # sequences whose prompts are going in: (their own one-row cache, the tokens it holds)
        self.joining: dict[object, tuple[BatchKV, list[int]]] = {}

    def prefill(self, sequence: object, tokens: Sequence[int]) -> None:
        own, fed = self.joining.setdefault(
            sequence, (BatchKV(self.draft.model, self.draft.device, rows=1), [])
        )
        if tokens:
            # logits_to_keep=1 skips the vocabulary projection of the prompt: only its cache is wanted
            own.forward([list(tokens)], logits_to_keep=1)
            fed.extend(tokens)

    def _join(self, sequence: object) -> None:
        own, fed = self.joining.pop(sequence, None) or (
            BatchKV(self.draft.model, self.draft.device, rows=1),
            [],
        )
        self.kv.add(own)
        self.keys.append(sequence)
        self.cached.append(fed)

    def leave(self, sequence: object) -> None:
        self.joining.pop(sequence, None)
        if sequence in self.keys:
            row = self.keys.index(sequence)
            del self.keys[row]
            del self.cached[row]
            self.kv.remove([row])

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        """Drafts for `rows`; the batch's other sequences sit the round out (they catch up the next time
        they draft)."""
        if not any(row.model_limit > 0 for row in rows):
            return [Draft([]) for _ in rows]
        for row in rows:
            if row.sequence not in self.keys:
                self._join(row.sequence)
        wanted = {row.sequence: row for row in rows if row.model_limit > 0}
        feeds: list[list[int]] = []
        for index, key in enumerate(self.keys):
            cached = self.cached[index]
            if key not in wanted:
                feeds.append([cached[-1]] if cached else [0])  # a dummy, dropped below
                continue
            committed = wanted[key].committed
            keep, limit = 0, min(len(cached), len(committed) - 1)  # the newest committed token must be fed
            while keep < limit and cached[keep] == committed[keep]:
                keep += 1
            self.kv.keep(index, keep)
            del cached[keep:]
            feeds.append(list(committed[keep:]))
        positions = max(row.model_limit for row in wanted.values())
        tokens: dict[object, list[int]] = {key: [] for key in wanted}
        probs: dict[object, list[torch.Tensor]] = {key: [] for key in wanted}
        for i in range(positions):
            bases = [self.kv.length(index) for index in range(len(self.keys))]
            logits = self.kv.forward(feeds)
            next_feeds: list[list[int]] = []
            for index, key in enumerate(self.keys):
                fed = feeds[index]
                if key not in wanted or i >= wanted[key].model_limit:  # this row fed a dummy: drop it again
                    self.kv.keep(index, bases[index])
                    next_feeds.append([self.cached[index][-1] if self.cached[index] else 0])
                    continue
                self.cached[index].extend(fed)
                token, p = _pick(logits[index, len(fed) - 1].float(), wanted[key])
                tokens[key].append(token)
                if p is not None:
                    probs[key].append(p)
                next_feeds.append([token])
            feeds = next_feeds
        self.kv.settle()
        return [
            Draft(tokens[row.sequence], torch.stack(probs[row.sequence]) if probs[row.sequence] else None)
            if row.sequence in wanted
            else Draft([])
            for row in rows
        ]


def _pick(logits: torch.Tensor, row: DraftRow) -> tuple[int, torch.Tensor | None]:
    if row.sampling.greedy:
        return int(logits.argmax()), None
    probs = sampling_probs(logits, row.sampling.temperature, row.sampling.top_p)
    return int(torch.multinomial(probs, 1, generator=row.generator)), probs
