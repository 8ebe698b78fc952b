"""Drafters: what proposes the tokens a target forward verifies.

A `Drafter` is shared by all requests (it holds the model, or just settings); `Drafter.start()` gives a
per-sequence `DrafterSession` that keeps its own state incrementally. A session is told the committed
sequence (prompt + output so far) at every round and works out by itself what changed since the last one:
- the n-gram drafter indexes only the new tokens (never rescans the text);
- the model drafter crops its KV cache back to what was kept and feeds only the new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from service.decoding.batch_kv import BatchKV
from service.decoding.models import LoadedModel
from service.decoding.types import DecodingError, SamplingParams
from service.decoding.verification import sampling_probs


@dataclass
class Draft:
    tokens: list[int]
    # [len(tokens), V] the draft's sampling distributions, or None for a point mass (greedy or n-gram)
    probs: torch.Tensor | None = None
    # what the draft policy learns acceptance per: the matched n-gram length, 0 for a draft model
    key: int = 0


class DrafterSession(Protocol):
    """A cheap drafter's per-sequence state. (A draft model's session only carries the sequence's sampling
    settings: the batch drafts for all its rows at once through `ModelDraftRows`.)"""

    def propose(self, committed: Sequence[int], k: int) -> Draft:
        """Up to k tokens to follow `committed` (which only ever grows by what the target kept)."""
        ...


class Drafter(Protocol):
    name: str  # "ngram" or "model"; labels metrics and namespaces the OCM
    # True when proposing costs next to nothing (n-gram lookup): the draft policy then sees the draft before
    # choosing its length; for a draft model it chooses first, so no draft forward is wasted.
    cheap: bool

    @property
    def identity(self) -> str:
        """What the OCM namespace calls this drafter: the draft model's id, or "ngram"."""
        ...

    def start(
        self, sampling: SamplingParams, generator: torch.Generator | None
    ) -> DrafterSession | ModelDraftSession: ...


# ---------------------------------------------------------------- n-gram (prompt lookup)


class NgramDrafter:
    """Prompt lookup: the longest recent n-gram match in prompt + output proposes what followed it.

    Training-free and nearly free to run; the default drafter on CPU, where a draft model's own forwards
    would cost as much as they save.
    """

    name = "ngram"
    cheap = True

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise DecodingError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    @property
    def identity(self) -> str:
        return "ngram"

    def start(self, sampling: SamplingParams, generator: torch.Generator | None) -> NgramSession:
        return NgramSession(self.min_n, self.max_n)


class NgramSession:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        # n-gram -> end position of its most recent occurrence that has a continuation
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed_until = 0  # n-grams ending before this position are in the index

    def _extend_index(self, tokens: Sequence[int]) -> None:
        # Index n-grams ending at positions up to len - 2 only: the one ending at len - 1 is the suffix we
        # look up, and indexing it would make every lookup find itself.
        last_end = len(tokens) - 2
        for end in range(self._indexed_until, last_end + 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._index[tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed_until = max(self._indexed_until, last_end + 1)

    def propose(self, committed: Sequence[int], k: int) -> Draft:
        self._extend_index(committed)
        length = len(committed)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._index.get(tuple(committed[length - n :]))
            if end is not None:
                return Draft(list(committed[end + 1 : end + 1 + k]), key=n)
        return Draft([])


# ---------------------------------------------------------------- draft model


class ModelDrafter:
    """Any causal LM sharing the target's vocabulary (a small model of the target's family)."""

    name = "model"
    cheap = False

    def __init__(self, draft: LoadedModel) -> None:
        self.draft = draft

    @property
    def identity(self) -> str:
        return f"{self.draft.name}@{self.draft.revision}"

    def start(self, sampling: SamplingParams, generator: torch.Generator | None) -> ModelDraftSession:
        return ModelDraftSession(self.draft, sampling, generator)


class ModelDraftSession:
    """A sequence's draft-model settings; its cache lives in the batch's `ModelDraftRows`, which drafts
    for every sequence of a batch in one draft forward per draft position."""

    def __init__(
        self, draft: LoadedModel, sampling: SamplingParams, generator: torch.Generator | None
    ) -> None:
        self.draft = draft
        self.sampling = sampling
        self.generator = generator


class ModelDraftRows:
    """The draft model's KV cache for the sequences of one batch that draft with it, one row each.

    Per round, `propose()` runs 1 + (k - 1) draft forwards for all rows together:
    1. catch-up: each row rolls its cache back to the longest prefix the target kept (the rejected draft
       tokens become dead slots) and feeds the committed tokens it has not seen (usually the last one or two);
    2. each further position feeds every row the token it just drafted.
    Rows that draft fewer tokens (their budget is nearly spent) feed a dummy token that is dropped at once,
    so every row takes part in every forward. Prompts are prefilled outside, chunk by chunk, by the batch.
    """

    def __init__(self, draft: LoadedModel) -> None:
        self.draft = draft
        self.kv = BatchKV(draft.model, draft.device)
        self.keys: list[object] = []  # row -> the sequence it drafts for
        self.cached: list[list[int]] = []  # row -> token ids whose keys/values are live in self.kv

    def new_row(self) -> BatchKV:
        """A one-row cache to prefill a joining sequence's prompt into (then `join`)."""
        return BatchKV(self.draft.model, self.draft.device, rows=1)

    def join(self, key: object, own: BatchKV, prefilled: Sequence[int]) -> None:
        self.kv.add(own)
        self.keys.append(key)
        self.cached.append(list(prefilled))

    def leave(self, key: object) -> None:
        if key in self.keys:
            row = self.keys.index(key)
            del self.keys[row]
            del self.cached[row]
            self.kv.remove([row])

    def propose(
        self, wanted: dict[object, tuple[Sequence[int], int, ModelDraftSession]]
    ) -> dict[object, Draft]:
        """Drafts for the rows in `wanted` (key -> (committed, k >= 1, session)); the other rows sit the
        round out (they catch up the next time they draft)."""
        if not wanted or not self.keys:
            return {}
        feeds: list[list[int]] = []
        for row, key in enumerate(self.keys):
            committed = wanted[key][0] if key in wanted else None
            cached = self.cached[row]
            if committed is None:
                feeds.append([cached[-1]] if cached else [0])  # a dummy, dropped below
                continue
            keep, limit = 0, min(len(cached), len(committed) - 1)  # the newest committed token must be fed
            while keep < limit and cached[keep] == committed[keep]:
                keep += 1
            self.kv.keep(row, keep)
            del cached[keep:]
            feeds.append(list(committed[keep:]))
        rounds = max(k for _, k, _ in wanted.values())
        tokens: dict[object, list[int]] = {key: [] for key in wanted}
        probs: dict[object, list[torch.Tensor]] = {key: [] for key in wanted}
        for i in range(rounds):
            bases = [self.kv.length(row) for row in range(len(self.keys))]
            logits = self.kv.forward(feeds)
            next_feeds: list[list[int]] = []
            for row, key in enumerate(self.keys):
                fed = feeds[row]
                if key not in wanted or i >= wanted[key][1]:  # this row fed a dummy: drop it again
                    self.kv.keep(row, bases[row])
                    next_feeds.append([self.cached[row][-1] if self.cached[row] else 0])
                    continue
                self.cached[row].extend(fed)
                token, p = self._pick(logits[row, len(fed) - 1].float(), wanted[key][2])
                tokens[key].append(token)
                if p is not None:
                    probs[key].append(p)
                next_feeds.append([token])
            feeds = next_feeds
        self.kv.settle()
        return {key: Draft(tokens[key], torch.stack(probs[key]) if probs[key] else None) for key in wanted}

    @staticmethod
    def _pick(logits: torch.Tensor, session: ModelDraftSession) -> tuple[int, torch.Tensor | None]:
        if session.sampling.greedy:
            return int(logits.argmax()), None
        probs = sampling_probs(logits, session.sampling.temperature, session.sampling.top_p)
        return int(torch.multinomial(probs, 1, generator=session.generator)), probs
