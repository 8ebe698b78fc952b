"""Rescues CSD refuses because they would change what is said: a fact, judged with its context.

The semantic gate asks only whether the target finds the draft token plausible, and at tau = 0.01 a
plausible alternative can be a different fact: calibrated CSD with prompt lookup rescued '1' -> '2' and
'0' -> '1' (a numbered list, a figure, changed silently). A rescue keeps the *draft's* token where the
target preferred another, so the guard refuses it when it would start, end, break or change:
- a number: any token with a digit, number words ("two", "third", "hundred", ...), and, after a digit, the
  tokens that join digits or continue the number ("2" + "." + "17", "1" + "," + "000", "12" + ":" + "30",
  "1" + "st"): "room 2.17" must not become "room 2," (a ',' kept where the target wanted the '.');
- a date: month and weekday names;
- a negation: "not", "no", "never", "n't", "'t", ... (keeping or dropping one flips a statement);
- a name: capitalised words ("Paris", "Lindqvist"), except the common words that begin sentences ("The",
  "This", "However", ...), which are the formatting and connective rescues CSD is for; and inside a word that
  is a name or a number, any token that continues it (" Cur" + "ie" is not " Cur" + "ry");
- a reference or quantity: one determiner for another (" a" -> " the", " some" -> " all"; "on a Saturday"
  became "on the 1st of each month" after such a rescue);
- a sentence's end: a token that ends a sentence ('.', '!', '?') for one that does not, or the reverse. The
  end of a sentence is where an answer may end, so a ',' kept where the target wanted '.' runs the answer on:
  in the benchmark's unseen QA prompts it turned "... is the River Tessel." into "... River Tessel, which
  carries snowmelt ... Kelvar." (14 -> 32 tokens), and a list of names into another list.
Judged with the tokens before the rescue (the committed text and the draft kept so far) and the two tokens.
Cheap by construction: one byte of flags per vocabulary token, computed once per tokenizer
(`token_classes`), then a handful of lookups per refused-or-not rescue (`fact_refusal`). It is a
heuristic; the benchmark counts what still changes in the outputs (numbers, dates and names of vanilla's
output missing from a method's: `bench.suite.output_fact_changes`). The divergence is still recorded in the OCM.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.executor.models import LoadedModel

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
DATE_WORDS = frozenset(
    [
        "january",
        "february",
        "march",
        "april",
        "may",
        "june",
        "july",
        "august",
        "september",
        "october",
        "november",
        "december",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "monday",
        "tuesday",
        "wednesday",
        "thursday",
        "friday",
        "saturday",
        "sunday",
    ]
)
# Swapping one for another changes what is referred to or how much: "a" / "the", "some" / "all".
DETERMINERS = frozenset(
    [
        "a",
        "an",
        "the",
        "this",
        "that",
        "these",
        "those",
        "each",
        "every",
        "some",
        "any",
        "all",
        "many",
        "few",
        "several",
        "most",
        "both",
        "either",
    ]
)
# Tokens that join the digits of one number: "2.17", "1,000", "12:30", "3/4", "2024-05".
NUMBER_JOINERS = frozenset([".", ",", ":", "/", "-", "–"])
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
    if lower in NEGATIONS or lower.endswith("n't") or lower in ("'t", "\u2019t"):
        return "negation"
    if lower in DATE_WORDS and word[0].isupper():  # "may" the verb is no date, "May" may be one
        return "date"
    if (
        _WORD.fullmatch(word)
        and word[0].isupper()
        and (len(word) == 1 or word[1:].islower())
        and word not in COMMON_CAPITALISED
    ):
        return "name"
    return None


def changes_fact(draft_text: str, target_text: str) -> str | None:
    """The class of fact a rescue of `draft_text` in place of `target_text` would change, or None (the two
    tokens' texts only: what the report counts over token pairs)."""
    return fact_class(draft_text) or fact_class(target_text)


# ---------------------------------------------------------------- per-token flags, once per vocabulary

FACT = 1  # a number, date, negation or name by itself (`fact_class`)
DIGIT_END = 2  # its text ends with a digit: a number may go on after it
NUMBER_JOIN = 4  # exactly one of NUMBER_JOINERS, no space: between digits it is part of the number
CONTINUES_WORD = 8  # starts with a letter or digit, no space before: it continues the word before it
DETERMINER = 16  # " a", " the", " some", ...
SPECIAL = 32  # a special token (end of turn, end of text, chat markers): the turn guard's concern
WORD_START = 64  # starts with whitespace or is punctuation: the word before it has ended
SENTENCE_END = 128  # ends with '.', '!' or '?' (closing quotes and brackets aside): a sentence may end here

# committed tokens a rescue rule and its guards see before the round's draft (verification's `before`), and
# so how far back a word in progress is looked for: enough for a word or a number in progress (a name rarely
# takes more sub-word tokens than this)
CONTEXT_TOKENS = 8

_SPACE_MARKERS = ("\u0120", "\u2581", " ")  # byte-level BPE's "G", SentencePiece's "_" and a plain space


def _flags(token: str, text: str) -> int:
    flags = FACT if fact_class(text) is not None else 0
    stripped = text.strip()
    if stripped and stripped[-1].isdigit():
        flags |= DIGIT_END
    if text in NUMBER_JOINERS:
        flags |= NUMBER_JOIN
    starts_with_space = token.startswith(_SPACE_MARKERS) or text[:1].isspace()
    if text[:1].isalnum() and not starts_with_space:
        flags |= CONTINUES_WORD
    else:
        flags |= WORD_START
    if stripped.rstrip("\"')]").endswith((".", "!", "?")):
        flags |= SENTENCE_END
    word = stripped.strip('.,;:!?"()[]').lower()
    if word in DETERMINERS and starts_with_space:
        flags |= DETERMINER
    return flags


@dataclass(frozen=True)
class TokenClasses:
    """One byte of flags per token id (FACT, DIGIT_END, ...): what the guards look up on the hot path."""

    flags: bytes

    def __getitem__(self, token: int) -> int:
        return self.flags[token] if 0 <= token < len(self.flags) else 0

    @classmethod
    def from_texts(cls, texts: Sequence[str], special: Sequence[int] = ()) -> TokenClasses:
        """Token id i has text texts[i] (hand-built vocabularies in tests; a leading space starts a word)."""
        flags = bytearray(_flags(text, text) for text in texts)
        for token_id in special:
            flags[token_id] = SPECIAL
        return cls(bytes(flags))

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, f in enumerate(self.flags) if f & SPECIAL)

    @property
    def fact_ids(self) -> frozenset[int]:
        return frozenset(i for i, f in enumerate(self.flags) if f & FACT)


def special_token_ids(tokenizer, extra: Sequence[int] = ()) -> set[int]:
    """Every special token: the tokenizer's named ones, added tokens marked special, and `extra` (EOS ids)."""
    ids = set(tokenizer.all_special_ids) | {int(t) for t in extra}
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def token_classes(tokenizer, vocab_size: int = 0, special: Sequence[int] = ()) -> TokenClasses:
    """The flags of every token id below max(vocab_size, len(tokenizer)); ids the tokenizer lacks (padding
    rows of the LM head) have none. `special`: more special ids (the model's EOS ids)."""
    flags = bytearray(max(vocab_size, len(tokenizer)))
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < len(flags):
            flags[token_id] = _flags(token, tokenizer.convert_tokens_to_string([token]))
    for token_id in special_token_ids(tokenizer, special):
        if 0 <= token_id < len(flags):
            flags[token_id] = SPECIAL
    return TokenClasses(bytes(flags))


def model_token_classes(target: LoadedModel) -> TokenClasses:
    """`token_classes` of a loaded model's vocabulary (its EOS ids special), built once and kept with it."""
    return target.memo(
        "token_classes",
        lambda: token_classes(target.tokenizer, target.vocab_size, sorted(target.eos_token_ids())),
    )


def model_special_ids(target: LoadedModel) -> frozenset[int]:
    """Special tokens (end of turn, end of text, chat markers) and the model's EOS ids: the turn guard's."""
    return target.memo("special_ids", lambda: model_token_classes(target).special_ids)


# ---------------------------------------------------------------- the guard


def fact_refusal(classes: TokenClasses, before: Sequence[int], draft: int, top: int) -> str | None:
    """Why keeping `draft` where the target chose `top`, after the tokens `before` (the committed text and
    the draft kept so far; only the last CONTEXT_TOKENS matter), would change a fact; None if it would not.

    "fact": either token is a number, date, negation or name; "number": after a digit, either token joins
    digits or continues the number ("2" "." vs "2" ","); "word": inside a word that is a name or a number,
    either token continues it; "determiner": one determiner for another; "sentence": exactly one of the two
    ends a sentence (judged after "number", so a '.' between digits is a number's).
    """
    d, t = classes[draft], classes[top]
    if (d | t) & FACT:
        return "fact"
    if d & t & DETERMINER:
        return "determiner"
    last = classes[before[-1]] if before else 0
    if last & DIGIT_END and (d | t) & (NUMBER_JOIN | CONTINUES_WORD):
        return "number"
    if (d ^ t) & SENTENCE_END:
        return "sentence"
    if not before:
        return None
    if (d | t) & CONTINUES_WORD:
        # the word the rescue would continue: back over the tokens that continue it, to the one that began it
        for token in reversed(before[-CONTEXT_TOKENS:]):
            flags = classes[token]
            if flags & FACT:
                return "word"
            if not flags & CONTINUES_WORD:
                break
    return None


def fact_token_ids(tokenizer) -> frozenset[int]:
    """Every token id of the vocabulary that belongs to a fact class by itself."""
    return token_classes(tokenizer).fact_ids
