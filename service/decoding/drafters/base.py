"""The drafter boundary: every drafter proposes for the rows of a round, in one call.

A `Drafter` is shared by all requests of an engine (it holds a model, or just settings). A batch asks it once
for `rows()`: the drafter's state for the sequences of that batch (a draft model's KV cache, the n-gram
indexes). Per round the batch calls `propose()` with one `DraftRow` per sequence that may speculate and gets
one `Draft` back per row, in order; rows join through `prefill()` (the prompt, chunk by chunk, as the target
sees it) and leave through `leave()`. Drafters that need no per-sequence state ignore both.

What a row offers every drafter:
- `committed`: the sequence so far (prompt + kept output). It only ever grows by what the target kept, so a
  stateful drafter works out by itself what changed since the last round (n-gram: index the new tokens;
  draft model: roll back to the kept prefix and feed the rest).
- `target_hidden`: the target's final hidden state (its LM head's input) at the position that chose the
  last committed token: what a draft head on the target's features starts from.
- `max_tokens`: the most draft tokens the row may verify this round (its token budget and context room).
- `model_tokens`: the most positions a drafter that runs a model (the head, a draft model) may draft for it
  this round: the draft policy's choice (`DraftPolicy.draft_length`), weighed against what a position
  costs. A lookup (prompt lookup, suffix) costs nothing and drafts up to `max_tokens` whatever it is, so
  `combined` keeps its lookup drafts whole where the policy gives the head no position at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from service.decoding.types import SamplingParams


@dataclass
class Draft:
    tokens: list[int]
    # [len(tokens), V] the draft's sampling distributions, or None for a point mass (greedy or n-gram)
    probs: torch.Tensor | None = None
    # what the draft policy learns acceptance per: the matched n-gram length, 0 for a draft model
    key: int = 0

    def cut(self, length: int) -> Draft:
        """The first `length` tokens (the batch verifies no more than its draft cap)."""
        if length >= len(self.tokens):
            return self
        probs = self.probs[:length] if self.probs is not None else None
        return Draft(self.tokens[:length], probs, self.key)


@dataclass
class DraftRow:
    """One sequence asking for a draft this round."""

    sequence: object  # the sequence's identity (stable while it is in the batch)
    committed: Sequence[int]
    max_tokens: int  # >= 1
    sampling: SamplingParams
    generator: torch.Generator | None
    target_hidden: torch.Tensor | None  # [hidden]; None before the target has seen any of the prompt
    # whose earlier outputs may shape this row's draft, and which pool its output joins (the API's tenant;
    # `SpeculativeConfig.draft_pool`); None: the row's own text only
    pool: str | None = None
    # the most positions a model-run drafter may draft (the draft policy's length); None: max_tokens
    model_tokens: int | None = None

    @property
    def model_limit(self) -> int:
        """How far a drafter that runs a model drafts this row: `max_tokens`, or less where the policy says."""
        return (
            self.max_tokens if self.model_tokens is None else max(0, min(self.max_tokens, self.model_tokens))
        )


class BatchDrafter(Protocol):
    """A drafter's state for the sequences of one batch."""

    def prefill(self, sequence: object, tokens: Sequence[int]) -> None:
        """A joining sequence's next prompt chunk (all prompt tokens but the last arrive this way)."""
        ...

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        """One draft per row (possibly empty), each at most `row.max_tokens` long."""
        ...

    def leave(self, sequence: object) -> None:
        """The sequence finished or was cancelled: forget it."""
        ...


class Drafter(Protocol):
    name: str  # "ngram", "head", "model", ...: labels metrics and the API's `drafter` field

    @property
    def identity(self) -> str:
        """What the OCM namespace calls this drafter: the draft model's id, "ngram", the head's id."""
        ...

    def rows(self) -> BatchDrafter: ...


class Stateless:
    """`prefill` and `leave` for drafters that keep nothing per sequence."""

    def prefill(self, sequence: object, tokens: Sequence[int]) -> None:
        return None

    def leave(self, sequence: object) -> None:
        return None
