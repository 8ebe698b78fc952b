"""What a request produced, gathered from its events as they arrive: per choice its text, finish reason,
provenance, logprobs and the tokens streamed so far; per request its totals, the one source of every API's
usage (chat's and completions' `usage`, the Responses API's `usage`, the streamed usage so far).

The driver (`driver.py`) adds every event to the request's `Results`, streamed or not; the formatters only
read them. Choices are numbered prompt by prompt (completions may send a batch), as OpenAI and vLLM do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.api.events import DoneEvent, Event, GenerationPlan, PromptEvent, RoundEvent
from service.api.schemas import ProvenanceToken
from service.decoding import GenerationStats
from service.decoding.types import EmittedToken, combined_stats


def provenance_tokens(event: RoundEvent) -> list[ProvenanceToken]:
    texts = event.token_texts or []
    out = []
    for token, (text, replaced_text) in zip(event.tokens, texts, strict=False):
        out.append(
            ProvenanceToken(
                id=token.token_id,
                text=text,
                provenance=token.provenance.value,
                replaced_id=token.replaced_token_id,
                replaced_text=replaced_text,
            )
        )
    return out


@dataclass
class ChoiceResult:
    """One choice's output, gathered from its events."""

    index: int
    text: str = ""
    finish_reason: str = "stop"
    stats: GenerationStats | None = None  # set when it finished
    generated: int = 0  # tokens its rounds emitted so far (the usage so far of a stream)
    provenance: list[ProvenanceToken] = field(default_factory=list)
    tokens: list[EmittedToken] = field(default_factory=list)  # with logprobs: every emitted token
    texts: dict[int, str] = field(default_factory=dict)  # token id -> text, for logprobs
    raw: dict[int, bytes] = field(default_factory=dict)  # token id -> its own bytes, for chat logprobs

    def add_round(self, event: RoundEvent) -> None:
        self.generated += event.num_tokens
        self.provenance.extend(provenance_tokens(event))
        if event.logprob_texts is not None:
            self.tokens.extend(event.tokens)
            self.texts.update(event.logprob_texts)
            self.raw.update(event.logprob_bytes or {})

    def finish(self, event: DoneEvent) -> None:
        self.text, self.finish_reason, self.stats = event.text, event.finish_reason, event.stats


@dataclass
class PromptResult:
    """One prompt of a request: its choices, and its own logprobs when echo asked for them."""

    plan: GenerationPlan
    choices: list[ChoiceResult]
    prompt: PromptEvent | None = None

    @property
    def done(self) -> bool:
        return all(c.stats is not None for c in self.choices)

    def add(self, event: Event) -> None:
        if isinstance(event, PromptEvent):
            self.prompt = event
        elif isinstance(event, RoundEvent):
            self.choices[event.index].add_round(event)
        elif isinstance(event, DoneEvent):
            self.choices[event.index].finish(event)


def request_stats(results: list[PromptResult]) -> GenerationStats:
    """A request's totals: each prompt counted once, every choice's output."""
    parts = [c.stats for r in results for c in r.choices if c.stats is not None]
    total = combined_stats(parts, sum(len(r.plan.prompt_ids) for r in results))
    # a prompt's choices share one prefill, so its cached tokens count once, like its prompt tokens
    total.cached_tokens = sum(
        max((c.stats.cached_tokens for c in r.choices if c.stats is not None), default=0) for r in results
    )
    return total


class Results:
    """A request's outputs, one `PromptResult` per prompt, filled in by the driver as events arrive."""

    def __init__(self, plans: list[GenerationPlan]) -> None:
        self.prompts = [PromptResult(plan, [ChoiceResult(index=i) for i in range(plan.n)]) for plan in plans]

    @property
    def done(self) -> bool:
        """Every choice of every prompt has finished: the request has stopped."""
        return all(p.done for p in self.prompts)

    @property
    def generated(self) -> int:
        """Tokens emitted so far, every choice's."""
        return sum(c.generated for p in self.prompts for c in p.choices)

    @property
    def choices(self) -> list[tuple[int, PromptResult, ChoiceResult]]:
        """(request-wide index, its prompt, the choice), numbered prompt by prompt."""
        out, index = [], 0
        for prompt in self.prompts:
            for choice in prompt.choices:
                out.append((index, prompt, choice))
                index += 1
        return out

    def provenance(self) -> list[ProvenanceToken]:
        return [t for p in self.prompts for c in p.choices for t in c.provenance]

    def totals(self) -> GenerationStats:
        """The request's usage and statistics (once it has finished)."""
        return request_stats(self.prompts)
