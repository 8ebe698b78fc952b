"""Tokens CSD never rescues: those whose substitution would change a fact.

The semantic gate asks only whether the target finds the draft token plausible, and at tau = 0.01 a
plausible alternative can be a different fact: calibrated CSD with prompt lookup rescued '1' -> '2' and
'0' -> '1' (a numbered list, a figure, changed silently). A rescue keeps the *draft's* token where the
target preferred another, so the guard refuses it when either token belongs to a class where two different
tokens mean different things:
- numbers: any token with a digit, and number words ("two", "third", "hundred", ...);
- negations: "not", "no", "never", "n't", ... (keeping or dropping one flips a statement);
- names: capitalised words ("Paris", "Lindqvist"), except the common words that begin sentences ("The",
  "This", "However", ...), which are the formatting and connective rescues CSD is for.
It is a heuristic over the vocabulary, computed once per tokenizer; the benchmark measures what it blocks
and what it costs (docs/drafters.md). The divergence is still recorded in the OCM.
"""

from __future__ import annotations

import re

NUMBER_WORDS = frozenset(
    [
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
        "twenty",
        "thirty",
        "forty",
        "fifty",
        "sixty",
        "seventy",
        "eighty",
        "ninety",
        "hundred",
        "thousand",
        "million",
        "billion",
        "trillion",
        "first",
        "second",
        "third",
        "fourth",
        "fifth",
        "sixth",
        "seventh",
        "eighth",
        "ninth",
        "tenth",
        "once",
        "twice",
        "half",
        "dozen",
    ]
)
NEGATIONS = frozenset(
    [
        "no",
        "not",
        "never",
        "none",
        "nothing",
        "nobody",
        "nowhere",
        "neither",
        "nor",
        "cannot",
        "without",
        "n't",
        "nt",
        "don't",
        "doesn't",
        "didn't",
        "isn't",
        "aren't",
        "wasn't",
        "weren't",
        "won't",
        "can't",
        "couldn't",
        "shouldn't",
        "wouldn't",
        "hasn't",
        "haven't",
        "hadn't",
    ]
)
# Capitalised words that are not names: sentence starters, pronouns, connectives, titles of sections.
COMMON_CAPITALISED = frozenset(
    [
        "The",
        "This",
        "That",
        "These",
        "Those",
        "It",
        "Its",
        "In",
        "On",
        "At",
        "For",
        "To",
        "From",
        "With",
        "By",
        "As",
        "An",
        "A",
        "And",
        "But",
        "Or",
        "So",
        "If",
        "When",
        "While",
        "Then",
        "There",
        "Here",
        "However",
        "Therefore",
        "Also",
        "Finally",
        "First",
        "Second",
        "Third",
        "Next",
        "Last",
        "Overall",
        "Additionally",
        "Furthermore",
        "Moreover",
        "Instead",
        "Although",
        "Because",
        "Since",
        "After",
        "Before",
        "During",
        "Once",
        "Each",
        "Every",
        "Some",
        "Many",
        "Most",
        "All",
        "Both",
        "Other",
        "Another",
        "Such",
        "What",
        "Which",
        "Who",
        "Why",
        "How",
        "Where",
        "Yes",
        "Of",
        "I",
        "We",
        "You",
        "He",
        "She",
        "They",
        "My",
        "Our",
        "Your",
        "His",
        "Her",
        "Their",
        "Me",
        "Us",
        "Them",
        "Let",
        "Please",
        "Note",
        "Example",
        "Step",
        "Here's",
        "It's",
        "Let's",
        "Sure",
        "Thank",
        "Thanks",
        "Dear",
        "Hello",
        "Hi",
        "Best",
        "Regards",
        "Sincerely",
        "Title",
        "Summary",
        "Introduction",
        "Conclusion",
        "One",
        "Two",
        "Three",
        "Key",
        "Tip",
        "Tips",
        "Use",
        "Make",
        "Start",
        "Try",
        "Keep",
        "Write",
        "Read",
        "Be",
        "Do",
        "Don't",
        "Can",
        "Could",
        "Would",
        "Should",
        "Will",
        "May",
        "Might",
        "Must",
        "Is",
        "Are",
        "Was",
        "Were",
        "Has",
        "Have",
        "Had",
        "Not",
        "No",
    ]
)

_WORD = re.compile(r"[A-Za-z']+")


def fact_class(text: str) -> str | None:
    """The fact class of one token's text ("number", "negation", "name") or None."""
    stripped = text.strip()
    if not stripped:
        return None
    if any(c.isdigit() for c in stripped):
        return "number"
    word = stripped.strip('.,;:!?"()[]')
    lower = word.lower()
    if lower in NUMBER_WORDS:
        return "number"
    if lower in NEGATIONS or lower.endswith("n't"):
        return "negation"
    if (
        _WORD.fullmatch(word)
        and word[0].isupper()
        and (len(word) == 1 or word[1:].islower())
        and word not in COMMON_CAPITALISED
    ):
        return "name"
    return None


def changes_fact(draft_text: str, target_text: str) -> str | None:
    """The class of fact a rescue of `draft_text` in place of `target_text` would change, or None."""
    return fact_class(draft_text) or fact_class(target_text)


def fact_token_ids(tokenizer) -> frozenset[int]:
    """Every token id of the vocabulary that belongs to a fact class."""
    ids = []
    for token, token_id in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        if fact_class(text) is not None:
            ids.append(token_id)
    return frozenset(ids)
