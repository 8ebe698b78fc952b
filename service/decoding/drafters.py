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
from transformers import DynamicCache

from service.decoding.kv_cache import crop_cache
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

    def start(self, sampling: SamplingParams, generator: torch.Generator | None) -> DrafterSession: ...


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
    def __init__(
        self, draft: LoadedModel, sampling: SamplingParams, generator: torch.Generator | None
    ) -> None:
        self.model = draft.model
        self.device = draft.device
        self.sampling = sampling
        self.generator = generator
        self.cache = DynamicCache(config=self.model.config)
        self.cached: list[int] = []  # token ids whose keys/values are in self.cache
        self.synced = 0  # cached[:synced] is known to equal the committed sequence

    def _forward(self, ids: Sequence[int]) -> torch.Tensor:
        """Feed ids after the cache; returns the logits of the last one, [V]."""
        out = self.model(
            input_ids=torch.tensor([list(ids)], device=self.device), cache=self.cache, logits_to_keep=1
        )
        self.cached.extend(ids)
        return out.logits[0, -1].float()

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.sampling.greedy:
            return int(logits.argmax()), None
        probs = sampling_probs(logits, self.sampling.temperature, self.sampling.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator)), probs

    def propose(self, committed: Sequence[int], k: int) -> Draft:
        # Roll back: keep the longest prefix of the cache that the target kept (gpt-fast's edge case, where
        # every draft token was kept and the last one was never fed, falls out of this too).
        keep = self.synced
        limit = min(len(self.cached), len(committed) - 1)  # the newest committed token must be fed
        while keep < limit and self.cached[keep] == committed[keep]:
            keep += 1
        crop_cache(self.cache, keep)
        del self.cached[keep:]
        logits = self._forward(committed[keep:])
        self.synced = len(committed)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            token, probs = self._pick(logits)
            tokens.append(token)
            if probs is not None:
                rows.append(probs)
            if i < k - 1:
                logits = self._forward([token])
        return Draft(tokens, torch.stack(rows) if rows else None)
