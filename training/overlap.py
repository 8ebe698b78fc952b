"""The wall between training data and evaluation: no training prompt may share an 8-word sequence with any
`bench/` prompt (evaluation sets and calibration alike), so benchmark figures are on text the drafter never saw."""

from __future__ import annotations

import re


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def overlaps(prompt: str, banned: set[tuple[str, ...]], n: int = 8) -> bool:
    """Whether `prompt` shares an n-word sequence with the banned set (or equals a short banned prompt)."""
    words = _words(prompt)
    return bool(ngrams(prompt, n) & banned) or (len(words) < n and tuple(words) in banned)


def bench_ngrams(n: int = 8) -> set[tuple[str, ...]]:
    """Every n-word sequence of every bench prompt (evaluation sets and calibration), plus the prompts
    shorter than n words as whole sequences."""
    from bench.workloads import DATA_DIR, read_jsonl

    banned: set[tuple[str, ...]] = set()
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        for item in read_jsonl(path):
            for key in ("prompt", "passage", "question"):
                text = item.get(key)
                if not text:
                    continue
                banned |= ngrams(text, n)
                words = _words(text)
                if len(words) < n:
                    banned.add(tuple(words))
    return banned
