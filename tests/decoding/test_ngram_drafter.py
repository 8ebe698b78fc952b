"""The n-gram (prompt lookup) drafter: which continuation it proposes, and that its incremental index
agrees with a from-scratch scan."""

from __future__ import annotations

import random

import pytest

from service.decoding import DecodingError, NgramDrafter, SamplingParams
from service.decoding.drafters import DraftRow, NgramIndex


def session(min_n: int = 2, max_n: int = 4) -> NgramIndex:
    return NgramIndex(min_n, max_n)


def propose(tokens: list[int], k: int = 8, min_n: int = 2, max_n: int = 4) -> list[int]:
    return session(min_n, max_n).propose(tokens, k).tokens


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by brute force: for n from max_n down to min_n, the most recent earlier occurrence of
    the last n tokens (one that is not the suffix itself) proposes the k tokens that followed it."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):  # end of an earlier occurrence, newest first
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_proposes_continuation_of_most_recent_match():
    # (1, 2) occurs twice before the suffix; the later occurrence was followed by 4, 8.
    assert propose([1, 2, 3, 9, 1, 2, 4, 8, 1, 2], k=2) == [4, 8]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # The 3-gram (5, 1, 2) matches at the start (followed by 3, 7); the 2-gram (1, 2) has a more recent
    # match (followed by 4), which must lose.
    assert propose([5, 1, 2, 3, 7, 1, 2, 4, 5, 1, 2], k=2) == [3, 7]
    assert propose([5, 1, 2, 3, 7, 1, 2, 4, 5, 1, 2], k=2, max_n=2) == [4, 5]


def test_never_matches_the_suffix_itself():
    assert propose([1, 2]) == []  # the only (1, 2) is the suffix
    assert propose([7, 1, 2, 3]) == []
    # (1, 1) occurs at 0-1 and (as the suffix) at 1-2: the earlier one proposes what followed it.
    assert propose([1, 1, 1]) == [1]


def test_respects_k_and_the_end_of_the_sequence():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    for k in range(1, 10):
        assert propose(tokens, k=k) == [3, 4, 5, 6, 7, 1, 2][:k]


def test_min_n_bounds_the_match_length():
    tokens = [3, 9, 5, 3]
    assert propose(tokens, min_n=2) == []  # no earlier 2-gram (5, 3)
    assert propose(tokens, min_n=1) == [9, 5, 3]  # the 1-gram (3) matches at 0


@pytest.mark.parametrize(
    "tokens, k, draft, key",
    [
        # no earlier 2-gram (5, 3): the lone token 3 matches at 0 and proposes what followed it
        ([3, 9, 5, 3], 8, [9, 5, 3], 1),
        # 4 occurs at 0 and 2 before the suffix: the most recent one (followed by 8) proposes
        ([4, 7, 4, 8, 4], 2, [8, 4], 1),
        # a 2-gram match beats a more recent 1-gram one
        ([6, 4, 7, 4, 8, 6, 4], 2, [7, 4], 2),
        # the longest match up to max_n = 4 wins, however old
        ([1, 2, 3, 4, 5, 0, 2, 3, 4, 6, 0, 1, 2, 3, 4], 2, [5, 0], 4),
        # nothing matches: no draft (a plain decoding round)
        ([1, 2, 3], 8, [], 0),
    ],
)
def test_default_drafter_falls_back_to_one_token_matches(tokens, k, draft, key):
    """The served default (min_n 1, max_n 4; docs/prompt-lookup.md): the longest suffix n-gram with an
    earlier occurrence, its most recent occurrence, down to a single token."""
    rows = NgramDrafter().rows()
    (proposed,) = rows.propose([DraftRow("s", tokens, k, SamplingParams(), None, None)])
    assert (proposed.tokens, proposed.key) == (draft, key)


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(DecodingError, match="min_n"):
        NgramDrafter(3, 2)
    with pytest.raises(DecodingError, match="min_n"):
        NgramDrafter(0, 2)


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (2, 4), (1, 5)])
def test_incremental_index_equals_a_rescan(min_n, max_n):
    """A session that is shown a growing sequence (as the engine does) proposes exactly what a fresh
    session and the brute-force reference propose from scratch for every prefix."""
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(20):
        tokens: list[int] = [rng.randrange(5) for _ in range(rng.randint(1, 6))]
        incremental = session(min_n, max_n)
        for _ in range(40):
            k = rng.randint(1, 8)
            expected = reference(tokens, k, min_n, max_n)
            assert incremental.propose(tokens, k).tokens == expected, (tokens, k)
            assert session(min_n, max_n).propose(tokens, k).tokens == expected
            # the sequence grows by what a round keeps: part of the draft plus one target token
            kept = expected[: rng.randint(0, len(expected))]
            tokens = tokens + kept + [rng.randrange(5)]


def test_batched_rows_each_keep_their_own_index():
    """The batched interface proposes per row from that row's own sequence; a row that leaves is
    forgotten."""
    rows = NgramDrafter().rows()
    a, b = [1, 2, 3, 9, 1, 2], [5, 6, 7, 5, 6]

    def request(key, tokens):
        return DraftRow(key, tokens, 3, SamplingParams(), None, None)

    first, second = rows.propose([request("a", a), request("b", b)])
    assert (first.tokens, second.tokens) == ([3, 9, 1], [7, 5, 6])
    assert (first.key, second.key) == (2, 2)
    rows.leave("a")
    assert set(rows.indexes) == {"b"}
