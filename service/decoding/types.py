"""Plain data that crosses the boundary of the decoding core: configs, emitted tokens, round statistics.

Vocabulary (shared with the API, the metrics and the docs):
- accepted: a draft token kept because it equals the target's choice;
- rescued: a draft token kept by the OCM + SCG gates of Calibrated Speculative Decoding;
- recovered: the target's token emitted after the first real rejection of a round;
- bonus: the extra target token when every draft token of a round was kept;
- plain: a target token from a round that had no draft (vanilla decoding, or a drafter with nothing to say).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum


class Method(str, Enum):
    VANILLA = "vanilla"  # plain target decoding, the 1.00x baseline
    SD = "sd"  # strict (lossless) speculative decoding
    LOSSY = "lossy"  # static lenient baseline of the CSD paper
    CSD = "csd"  # Calibrated Speculative Decoding


class Provenance(str, Enum):
    ACCEPTED = "accepted"
    RESCUED = "rescued"
    RECOVERED = "recovered"
    BONUS = "bonus"
    PLAIN = "plain"


class DecodingError(ValueError):
    """A request the core cannot serve, worded for the user (bad parameter, model mismatch, ...)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How one generation speculates. Defaults are the CSD paper's (k = 6, lambda = 6, tau = 0.01)."""

    method: Method = Method.CSD
    num_speculative_tokens: int = 6
    # CSD frequency gate: rescue only when count(draft, target) > lambda_. math.inf disables rescue.
    lambda_: float = 6
    # CSD semantic consistency gate: p(draft) / p(target top) >= tau, on raw target logits.
    tau: float = 0.01
    # Lossy baseline: accept when p(draft) / p(target top) >= lossy_threshold.
    lossy_threshold: float = 0.6
    # CSD never rescues a token (or over a token) that starts, ends or changes a number, date, negation or
    # name, judged with the tokens before it (`fact_guard`)
    guard_facts: bool = True
    # CSD never rescues over a special token the target chose (its end of turn), nor keeps one over text
    guard_turns: bool = True
    # structured output: draft the tokens the grammar forces (jump-forward); off only to measure what it buys
    jump_forward: bool = True
    # drafters that learn across requests (suffix) draft from, and add the output to, this pool's earlier
    # outputs only: the API sets the request's tenant. None: the request's own text only
    draft_pool: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, Method):
            try:
                object.__setattr__(self, "method", Method(self.method))
            except ValueError:
                raise DecodingError(
                    f"unknown method {self.method!r}; choose one of {', '.join(m.value for m in Method)}"
                ) from None
        if not 0 <= self.num_speculative_tokens <= 64:
            raise DecodingError("num_speculative_tokens must be between 0 and 64")
        if not (0 < self.tau <= 1) or math.isnan(self.tau):
            raise DecodingError(f"tau must be in (0, 1], got {self.tau}")
        if not self.lambda_ >= 0:
            raise DecodingError(f"lambda must be >= 0, got {self.lambda_}")
        if not (0 < self.lossy_threshold <= 1):
            raise DecodingError(f"lossy_threshold must be in (0, 1], got {self.lossy_threshold}")

    @property
    def speculates(self) -> bool:
        return self.method is not Method.VANILLA and self.num_speculative_tokens > 0


GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20


class ConstraintKind(str, Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # value: the schema (a dict)
    REGEX = "regex"  # value: a regular expression the whole output matches
    CHOICE = "choice"  # value: a tuple of strings, the output is one of them
    GRAMMAR = "grammar"  # value: a Lark grammar (llguidance's dialect)


@dataclass(frozen=True)
class Constraint:
    """What the whole output must match (structured output). Enforced by `grammar.GrammarMatcher` at every
    position a round verifies, drafts included."""

    kind: ConstraintKind
    value: object = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            object.__setattr__(self, "kind", ConstraintKind(self.kind))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy.

    Logit processing, applied at every verified position from the tokens before it, exactly as plain
    decoding would (so strict speculative decoding stays lossless): `repetition_penalty` (vLLM's / CTRL's:
    divide positive logits, multiply negative ones, over prompt and output tokens), `presence_penalty` and
    `frequency_penalty` (OpenAI's, over output tokens), `logit_bias` (token id -> bias), `min_tokens` (EOS
    and `stop_token_ids` masked before that many tokens), and `constraint` (structured output).
    `logprobs`: how many top alternatives to report per token (None: no logprobs; 0: the chosen token's)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise DecodingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise DecodingError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise DecodingError(f"{name} must be in [-2, 2], got {value}")
        # a tiny penalty divides logits into inf (5e-324 did): the API's range starts at 0.01
        if not 0.01 <= self.repetition_penalty <= 2:
            raise DecodingError(f"repetition_penalty must be in [0.01, 2], got {self.repetition_penalty}")
        if any(not (-100 <= bias <= 100) for _, bias in self.logit_bias):
            raise DecodingError("logit_bias values must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise DecodingError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not (0 <= self.temperature <= 2) or math.isnan(self.temperature):
            raise DecodingError(f"temperature must be in [0, 2], got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise DecodingError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise DecodingError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that sampling is greedy anyway: below GREEDY_BELOW a logit gap of
        1e-3 already makes the runner-up e^-100 times less likely, and at 1e-38 and below logits / T
        overflows float32 (inf - inf = nan in the softmax)."""
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class EmittedToken:
    token_id: int
    provenance: Provenance
    # For a rescued token: the target's own top choice that it stood in for.
    replaced_token_id: int | None = None
    # With SamplingParams.logprobs: the target's log-probability of this token after logit processing (and
    # temperature), and its top alternatives as (token id, logprob), best first.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class RoundStats:
    """What one verification round did. One round = one target forward."""

    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_rescued: int = 0
    num_recovered: int = 0  # 0 or 1
    num_bonus: int = 0  # 0 or 1
    # per draft position: True if that draft token was kept (accepted or rescued)
    kept_per_position: list[bool] = field(default_factory=list)
    # per draft position: True if that draft token was accepted (equal to the target's choice; no rescue)
    accepted_per_position: list[bool] = field(default_factory=list)
    ocm_seconds: float = 0.0  # time spent in the correction memory (record + read)
    # tokens the round decided: those it emitted, plus the end-of-sequence token it ended on (set by
    # `emitted`); summed over rounds and divided by forwards it is GenerationStats.tokens_per_forward
    tokens_decided: int = 0

    @property
    def num_kept(self) -> int:
        return self.num_accepted + self.num_rescued

    def emitted(self, tokens: Sequence[EmittedToken], cut: bool, ended_on_eos: bool = False) -> RoundStats:
        """This round's statistics counting only `tokens`, the prefix of its verified tokens that was
        emitted. `cut`: an EOS, a stop string or the token budget ended the round before its last verified
        token; then only the draft positions it emitted count as drafted (what came after was verified
        for nothing and says nothing about the drafter)."""
        by = Counter(t.provenance for t in tokens)
        kept = by[Provenance.ACCEPTED] + by[Provenance.RESCUED]  # kept draft tokens come first in a round
        drafted = min(kept, self.num_draft_tokens) if cut else self.num_draft_tokens
        return RoundStats(
            num_draft_tokens=drafted,
            num_accepted=by[Provenance.ACCEPTED],
            num_rescued=by[Provenance.RESCUED],
            num_recovered=by[Provenance.RECOVERED],
            num_bonus=by[Provenance.BONUS],
            kept_per_position=[f and i < kept for i, f in enumerate(self.kept_per_position[:drafted])],
            accepted_per_position=[
                f and i < kept for i, f in enumerate(self.accepted_per_position[:drafted])
            ],
            ocm_seconds=self.ocm_seconds,
            tokens_decided=len(tokens) + int(ended_on_eos),
        )


@dataclass
class GenerationStats:
    """Running totals over a whole generation (sums of RoundStats plus timing). Each counter, once:

    | counter | counts |
    |---|---|
    | completion_tokens | tokens emitted: the provenance list. Not the EOS token that ends a generation (OpenAI's usage does not count it either), nor what a round verified past a stop string or the token budget |
    | num_accepted, num_rescued, num_recovered, num_bonus | emitted tokens of that provenance; with the plain ones (rounds without a draft) they sum to completion_tokens |
    | num_draft_tokens | draft tokens the target verified; in a round cut short (EOS, stop string, budget) only the draft positions it emitted, so acceptance_rate = num_accepted / num_draft_tokens judges the drafter on what counted |
    | num_drafts | rounds with at least one draft token counted in num_draft_tokens |
    | target_forwards | decoding rounds, one target forward each, the round that chose EOS included; prefill forwards are not rounds (their time is prefill_seconds) |
    | num_rejections_seen | rejections verification saw (a draft token not kept; at most one a round), whether or not the round emitted the recovered token after it (an EOS, stop string or the budget may cut it first; num_recovered counts only those emitted): in strict calibration each is a divergence pattern recorded in the OCM |
    | num_eos | 1 when the target chose an EOS token, which ended the generation (decided, never emitted) |
    | tokens_per_forward | (completion_tokens + num_eos) / target_forwards: tokens the rounds decided per forward; exactly 1.0 for vanilla decoding |
    | accepted_per_position, kept_per_position | rounds whose draft token at position i was emitted as accepted / as accepted or rescued |
    | forced_tokens | structured output: draft tokens the grammar forced (jump-forward) that the target verified |
    | grammar_seconds | structured output: time in the grammar engine (masks, draft checks, commits) |
    """  # noqa: E501

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache (not prefilled)
    completion_tokens: int = 0
    target_forwards: int = 0
    num_drafts: int = 0  # rounds that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_rescued: int = 0
    num_recovered: int = 0
    num_bonus: int = 0
    num_eos: int = 0
    num_rejections_seen: int = 0
    # per draft position i: rounds whose draft token i was accepted (strict, vLLM's definition) / kept
    # (accepted or rescued)
    accepted_per_position: list[int] = field(default_factory=list)
    kept_per_position: list[int] = field(default_factory=list)
    ocm_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    grammar_seconds: float = 0.0  # structured output: time in the grammar engine (masks, draft checks)
    forced_tokens: int = 0  # structured output: draft tokens the grammar forced (jump-forward), verified

    def add_round(self, r: RoundStats) -> None:
        self.target_forwards += 1
        if r.num_draft_tokens:
            self.num_drafts += 1
        self.num_draft_tokens += r.num_draft_tokens
        self.num_accepted += r.num_accepted
        self.num_rescued += r.num_rescued
        self.num_recovered += r.num_recovered
        self.num_bonus += r.num_bonus
        self.ocm_seconds += r.ocm_seconds
        _add_positions(self.accepted_per_position, r.accepted_per_position)
        _add_positions(self.kept_per_position, r.kept_per_position)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (strict: rescued tokens are not accepted); 0 when nothing was drafted."""
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def kept_rate(self) -> float:
        """(accepted + rescued) / drafted: what CSD keeps of the drafts."""
        return (
            (self.num_accepted + self.num_rescued) / self.num_draft_tokens if self.num_draft_tokens else 0.0
        )

    @property
    def rescue_rate(self) -> float:
        """rescued / drafted."""
        return self.num_rescued / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens decided per target forward (1.0 for vanilla decoding; vLLM's "mean acceptance length")."""
        return (self.completion_tokens + self.num_eos) / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        total = self.prefill_seconds + self.decode_seconds
        return self.completion_tokens / total if total > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "target_forwards": self.target_forwards,
            "num_drafts": self.num_drafts,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted,
            "rescued_tokens": self.num_rescued,
            "recovered_tokens": self.num_recovered,
            "bonus_tokens": self.num_bonus,
            "accepted_per_position": list(self.accepted_per_position),
            "kept_per_position": list(self.kept_per_position),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "kept_rate": round(self.kept_rate, 4),
            "rescue_rate": round(self.rescue_rate, 4),
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "ocm_seconds": round(self.ocm_seconds, 6),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "grammar_seconds": round(self.grammar_seconds, 6),
            "forced_tokens": self.forced_tokens,
        }


def combined_stats(parts: Sequence[GenerationStats], prompt_tokens: int) -> GenerationStats:
    """The totals of several generations (a request's choices); `prompt_tokens` counts each prompt once."""
    total = GenerationStats(prompt_tokens=prompt_tokens)
    for part in parts:
        for f in fields(GenerationStats):
            if f.name == "prompt_tokens":
                continue
            value = getattr(part, f.name)
            if isinstance(value, list):
                mine = getattr(total, f.name)
                mine.extend([0] * (len(value) - len(mine)))
                for i, count in enumerate(value):
                    mine[i] += count
            else:
                setattr(total, f.name, getattr(total, f.name) + value)
    return total


def _add_positions(totals: list[int], flags: list[bool]) -> None:
    if len(totals) < len(flags):
        totals.extend([0] * (len(flags) - len(totals)))
    for i, flag in enumerate(flags):
        totals[i] += int(flag)


@dataclass
class GenerationRound:
    """One generation's share of a round: the tokens it emitted (after stop handling) and the text they add."""

    tokens: list[EmittedToken]
    text: str
    round: RoundStats
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or None while running
