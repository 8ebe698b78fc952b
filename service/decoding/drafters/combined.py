"""Prompt lookup where it matches, the draft head elsewhere: the best of both, per row and per round.

Where the output copies its input (a summary quoting its passage, an edited piece of code) an n-gram match
proposes long runs the target accepts, at no cost; on open text it has nothing to say, and the head drafts.
A row whose suffix matches an n-gram of at least `min_match` tokens takes the n-gram draft; every other row
takes the head's (the head drafts for those rows only). Draft policy keys stay apart: the head's confidence
buckets (0..2) and 10 + the lookup's own key.

The lookup is prompt lookup (`combined`) or the suffix drafter (`combined-suffix`: its match may also be in
earlier outputs of the request's draft pool); each says how long the match behind a draft was
(`match_length`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from service.decoding.drafters.base import Draft, DraftRow
from service.decoding.drafters.head import HeadDrafter, HeadRows
from service.decoding.drafters.ngram import NgramDrafter, NgramRows
from service.decoding.drafters.suffix import SuffixDrafter, SuffixRows

NGRAM_KEY_OFFSET = 10


class CombinedDrafter:
    def __init__(
        self,
        ngram: NgramDrafter | SuffixDrafter,
        head: HeadDrafter,
        min_match: int = 3,
        name: str = "combined",
    ) -> None:
        self.ngram = ngram  # the lookup: prompt lookup, or the suffix drafter
        self.head = head
        self.min_match = min_match
        self.name = name

    @property
    def identity(self) -> str:
        return f"combined:{self.ngram.identity}+{self.head.identity}"

    def rows(self) -> CombinedRows:
        return CombinedRows(self.ngram.rows(), self.head.rows(), self.min_match, self.ngram.match_length)


class CombinedRows:
    def __init__(
        self,
        ngram: NgramRows | SuffixRows,
        head: HeadRows,
        min_match: int,
        match_length: Callable[[Draft], int] = lambda draft: draft.key,
    ) -> None:
        self.ngram = ngram
        self.head = head
        self.min_match = min_match
        self.match_length = match_length

    def prefill(self, sequence: object, tokens: Sequence[int]) -> None:
        self.ngram.prefill(sequence, tokens)
        self.head.prefill(sequence, tokens)

    def leave(self, sequence: object) -> None:
        self.ngram.leave(sequence)
        self.head.leave(sequence)

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        drafts = self.ngram.propose(rows)
        rest = [i for i, d in enumerate(drafts) if self.match_length(d) < self.min_match or not d.tokens]
        for i, d in enumerate(drafts):
            if i not in rest:
                d.key += NGRAM_KEY_OFFSET
        for i, draft in zip(rest, self.head.propose([rows[i] for i in rest]), strict=True):
            drafts[i] = draft
        return drafts
