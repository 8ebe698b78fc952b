"""Build OpenAI's response and stream-chunk shapes from the engine's events.

One formatter per endpoint: `CompletionFormatter` (object "text_completion") and `ChatFormatter`
("chat.completion" / "chat.completion.chunk", whose first chunk of each choice carries the assistant role).
A request's results arrive as `PromptResult`s (one per prompt: completions may send a batch), each with its
`ChoiceResult`s (n per prompt); choices are numbered prompt by prompt, as OpenAI and vLLM do.

Logprobs: the chat shape (`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`) and the legacy
completions shape (parallel `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists, whose
top dictionaries always hold the chosen token, as vLLM's do). A token's text is its own decoding.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel

from service.api.events import DoneEvent, GenerationPlan, PromptEvent, StepEvent
from service.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCallDelta,
    PromptTokensDetails,
    ProvenanceToken,
    SpeculativeStats,
    SpeculativeTokens,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from service.api.tools import CallStart, TextDelta, ToolPlan, collect
from service.decoding import GenerationStats
from service.decoding.types import EmittedToken, combined_stats


def usage(stats: GenerationStats) -> Usage:
    return Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens),
    )


def speculative_stats(
    plan: GenerationPlan, stats: GenerationStats, tokens: list[ProvenanceToken] | None = None
) -> SpeculativeStats:
    return SpeculativeStats(
        method=plan.method,
        drafter=plan.drafter if plan.spec.speculates else None,
        num_speculative_tokens=plan.spec.num_speculative_tokens if plan.spec.speculates else 0,
        draft_tokens=stats.num_draft_tokens,
        accepted_tokens=stats.num_accepted,
        rescued_tokens=stats.num_rescued,
        recovered_tokens=stats.num_recovered,
        bonus_tokens=stats.num_bonus,
        acceptance_rate=round(stats.acceptance_rate, 4),
        kept_rate=round(stats.kept_rate, 4),
        rescue_rate=round(stats.rescue_rate, 4),
        tokens_per_forward=round(stats.tokens_per_forward, 4),
        target_forwards=stats.target_forwards,
        forced_tokens=stats.forced_tokens,
        tokens=tokens,
    )


def provenance_tokens(event: StepEvent) -> list[ProvenanceToken]:
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
    stats: GenerationStats | None = None
    provenance: list[ProvenanceToken] = field(default_factory=list)
    tokens: list[EmittedToken] = field(default_factory=list)  # with logprobs: every emitted token
    texts: dict[int, str] = field(default_factory=dict)  # token id -> text, for logprobs
    raw: dict[int, bytes] = field(default_factory=dict)  # token id -> its own bytes, for chat logprobs

    def add_step(self, event: StepEvent) -> None:
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


def request_stats(results: list[PromptResult]) -> GenerationStats:
    """A request's totals: each prompt counted once, every choice's output."""
    parts = [c.stats for r in results for c in r.choices if c.stats is not None]
    total = combined_stats(parts, sum(len(r.plan.prompt_ids) for r in results))
    # a prompt's choices share one prefill, so its cached tokens count once, like its prompt tokens
    total.cached_tokens = sum(
        max((c.stats.cached_tokens for c in r.choices if c.stats is not None), default=0) for r in results
    )
    return total


def chat_logprobs(tokens: list[EmittedToken], texts: dict[int, str], raw: dict[int, bytes]) -> ChatLogprobs:
    """`raw`: each token's own bytes (pieces of one UTF-8 character join back into it, where the text of
    each piece alone is U+FFFD)."""
    return ChatLogprobs(
        content=[
            TokenLogprob(
                token=texts[t.token_id],
                logprob=t.logprob,
                bytes=list(raw[t.token_id]),
                top_logprobs=[
                    TopLogprob(token=texts[i], logprob=lp, bytes=list(raw[i])) for i, lp in t.top_logprobs
                ],
            )
            for t in tokens
        ]
    )


def completion_logprobs(
    entries: list[tuple[int, float | None, tuple[tuple[int, float], ...] | None]],
    texts: dict[int, str],
    offset: int = 0,
) -> CompletionLogprobs:
    """entries: (token id, its logprob or None, its alternatives or None) in text order."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token, logprob, top in entries:
        text = texts[token]
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        if logprob is None:
            out.top_logprobs.append(None)
        else:
            alternatives = {texts[i]: lp for i, lp in top or ()}
            alternatives.setdefault(text, logprob)
            out.top_logprobs.append(alternatives)
        out.text_offset.append(offset)
        offset += len(text)
    return out


class Formatter:
    """What one request's responses share: id, creation time, model name, usage chunk or not."""

    id_prefix = "cmpl"

    def __init__(
        self, model: str, plan: GenerationPlan, include_usage: bool = False, continuous_usage: bool = False
    ) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.plan = plan
        self.include_usage = include_usage
        # vLLM's continuous_usage_stats: every chunk carries the usage so far (`counted` tokens streamed)
        self.continuous_usage = include_usage and continuous_usage
        self.counted = 0

    def count(self, event: StepEvent) -> None:
        self.counted += event.num_tokens

    def with_usage(self, chunk: dict) -> dict:
        """A chunk with the usage so far, when the request asked for it on every chunk."""
        if self.continuous_usage and chunk.get("usage") is None:
            prompt = len(self.plan.prompt_ids)
            chunk["usage"] = Usage(
                prompt_tokens=prompt, completion_tokens=self.counted, total_tokens=prompt + self.counted
            ).model_dump(mode="json")
        return chunk

    @property
    def wants_logprobs(self) -> bool:
        return self.plan.sampling.logprobs is not None

    def _dump(self, chunk: BaseModel) -> dict:
        # OpenAI sends "usage": null on every chunk but the last when include_usage is on, and no key when off.
        return chunk.model_dump(mode="json", exclude=None if self.include_usage else {"usage"})

    def opening_chunks(self) -> list[dict]:
        return []

    def prompt_chunks(self, event: PromptEvent) -> list[dict]:
        return []

    def step_chunk(self, event: StepEvent) -> dict | None:
        raise NotImplementedError

    def finish_chunk(self, index: int, finish_reason: str, stats: GenerationStats) -> dict:
        raise NotImplementedError

    def step_chunks(self, event: StepEvent) -> list[dict]:
        """What one round sends: usually its one chunk; tool calls may need more (OpenAI sends a call's
        name and its arguments as two deltas)."""
        chunk = self.step_chunk(event)
        return [] if chunk is None else [chunk]

    def finish_chunks(self, index: int, finish_reason: str, stats: GenerationStats) -> list[dict]:
        """The chunks that end a choice: held-back text or tool calls, then its finish chunk."""
        return [self.finish_chunk(index, finish_reason, stats)]

    def usage_chunk(self, stats: GenerationStats) -> dict:
        raise NotImplementedError

    def response(self, results: list[PromptResult]) -> dict:
        raise NotImplementedError

    def _step_speculative(self, event: StepEvent) -> SpeculativeTokens | None:
        if not self.plan.return_provenance:
            return None
        return SpeculativeTokens(tokens=provenance_tokens(event), draft_tokens=event.draft_tokens)

    def _wants_chunk(self, event: StepEvent) -> bool:
        # A round whose text is held back (half a character, a possible stop string) sends nothing, unless
        # the client asked for provenance or logprobs: then the tokens go out as they are decided.
        asked = self.plan.return_provenance or self.wants_logprobs
        return bool(event.text) or (asked and event.num_tokens > 0)

    def _choices(self, results: list[PromptResult]) -> list[tuple[int, PromptResult, ChoiceResult]]:
        """(request-wide index, its prompt, the choice), numbered prompt by prompt."""
        out, index = [], 0
        for result in results:
            for choice in result.choices:
                out.append((index, result, choice))
                index += 1
        return out

    def _speculative(self, results: list[PromptResult]) -> SpeculativeStats:
        provenance = None
        if self.plan.return_provenance:
            provenance = [t for r in results for c in r.choices for t in c.provenance]
        return speculative_stats(self.plan, request_stats(results), provenance)


class CompletionFormatter(Formatter):
    id_prefix = "cmpl"

    def __init__(
        self, model: str, plan: GenerationPlan, include_usage: bool = False, continuous_usage: bool = False
    ) -> None:
        super().__init__(model, plan, include_usage, continuous_usage)
        self.echo = plan.echo_text  # the prompt's text, when the request asked for it back (a stream's one)
        # per choice: the length of the text streamed so far, where the next token's text_offset starts
        self._offsets = [len(self.echo or "")] * plan.n

    def _chunk(self, **kwargs: object) -> CompletionChunk:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, **kwargs)  # type: ignore[arg-type]

    def opening_chunks(self) -> list[dict]:
        if self.echo is None or self.plan.prompt_logprobs is not None:  # with logprobs: at the PromptEvent
            return []
        choices = [CompletionChoice(index=i, text=self.echo, finish_reason=None) for i in range(self.plan.n)]
        return [self._dump(self._chunk(choices=choices))]

    def prompt_chunks(self, event: PromptEvent) -> list[dict]:
        if self.echo is None:
            return []
        logprobs = completion_logprobs(_prompt_entries(event), event.texts)
        choices = [
            CompletionChoice(index=i, text=self.echo, logprobs=logprobs, finish_reason=None)
            for i in range(self.plan.n)
        ]
        return [self._dump(self._chunk(choices=choices))]

    def step_chunk(self, event: StepEvent) -> dict | None:
        if not self._wants_chunk(event):
            return None
        logprobs = None
        if event.logprob_texts is not None:
            offset = self._offsets[event.index]
            logprobs = completion_logprobs(_emitted_entries(event.tokens), event.logprob_texts, offset)
            self._offsets[event.index] = offset + sum(len(t) for t in logprobs.tokens)
        choice = CompletionChoice(index=event.index, text=event.text, logprobs=logprobs, finish_reason=None)
        return self._dump(self._chunk(choices=[choice], speculative=self._step_speculative(event)))

    def finish_chunk(self, index: int, finish_reason: str, stats: GenerationStats) -> dict:
        choice = CompletionChoice(index=index, text="", finish_reason=finish_reason)  # type: ignore[arg-type]
        return self._dump(self._chunk(choices=[choice], speculative=speculative_stats(self.plan, stats)))

    def usage_chunk(self, stats: GenerationStats) -> dict:
        return self._dump(
            self._chunk(choices=[], usage=usage(stats), speculative=speculative_stats(self.plan, stats))
        )

    def response(self, results: list[PromptResult]) -> dict:
        choices = []
        for index, result, choice in self._choices(results):
            text, entries, texts = choice.text, [], dict(choice.texts)
            echo = _echo_text(result) if self.echo is not None else None
            if echo is not None:
                text = echo + text
                if result.prompt is not None:
                    entries.extend(_prompt_entries(result.prompt))
                    texts.update(result.prompt.texts)
            logprobs = None
            if self.wants_logprobs:
                entries.extend(_emitted_entries(choice.tokens))
                logprobs = completion_logprobs(entries, texts)
            choices.append(
                CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason
                )  # type: ignore[arg-type]
            )
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage(request_stats(results)),
            speculative=self._speculative(results),
        ).model_dump(mode="json")


def _echo_text(result: PromptResult) -> str:
    return result.plan.echo_text or ""


def _prompt_entries(
    event: PromptEvent,
) -> list[tuple[int, float | None, tuple[tuple[int, float], ...] | None]]:
    return [
        (token, None, None) if entry is None else (token, entry[0], entry[1])
        for token, entry in zip(event.tokens, event.logprobs, strict=True)
    ]


def _emitted_entries(
    tokens: list[EmittedToken],
) -> list[tuple[int, float | None, tuple[tuple[int, float], ...]]]:
    return [(t.token_id, t.logprob, t.top_logprobs) for t in tokens]


class ChatFormatter(Formatter):
    """With `tools` (a ToolPlan), the generated text goes through its tool-call parser: content and
    tool calls in the response, content and tool-call deltas in the stream (one parser per choice)."""

    id_prefix = "chatcmpl"

    def __init__(
        self,
        model: str,
        plan: GenerationPlan,
        include_usage: bool = False,
        tools: ToolPlan | None = None,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(model, plan, include_usage, continuous_usage)
        self.tools = tools
        self._streams = {i: tools.stream() for i in range(plan.n)} if tools is not None else None

    def _chunk(self, **kwargs: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, **kwargs)  # type: ignore[arg-type]

    def opening_chunks(self) -> list[dict]:
        return [
            self._dump(
                self._chunk(choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            )
            for i in range(self.plan.n)
        ]

    def step_chunk(self, event: StepEvent) -> dict | None:
        if not self._wants_chunk(event):
            return None
        choice = ChatChunkChoice(
            index=event.index, delta=ChatDelta(content=event.text), logprobs=self._logprobs(event)
        )
        return self._dump(self._chunk(choices=[choice], speculative=self._step_speculative(event)))

    def _logprobs(self, event: StepEvent) -> ChatLogprobs | None:
        if event.logprob_texts is None:
            return None
        return chat_logprobs(event.tokens, event.logprob_texts, event.logprob_bytes or {})

    def finish_chunk(self, index: int, finish_reason: str, stats: GenerationStats) -> dict:
        if self.tools is not None and self._streams is not None:
            finish_reason = self.tools.finish_reason(finish_reason, called=self._streams[index].calls > 0)
        choice = ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish_reason)  # type: ignore[arg-type]
        return self._dump(self._chunk(choices=[choice], speculative=speculative_stats(self.plan, stats)))

    def step_chunks(self, event: StepEvent) -> list[dict]:
        if self._streams is None:
            return super().step_chunks(event)
        deltas = self._deltas(event.index, event.text)
        speculative, logprobs = self._step_speculative(event), self._logprobs(event)
        if (speculative is not None or logprobs is not None) and not deltas:  # tokens go out as decided
            deltas = [ChatDelta()]
        return [
            # the round's provenance and logprobs ride on its first chunk
            self._dump(
                self._chunk(
                    choices=[
                        ChatChunkChoice(index=event.index, delta=d, logprobs=logprobs if i == 0 else None)
                    ],
                    speculative=speculative if i == 0 else None,
                )
            )
            for i, d in enumerate(deltas)
        ]

    def finish_chunks(self, index: int, finish_reason: str, stats: GenerationStats) -> list[dict]:
        if self._streams is None:
            return super().finish_chunks(index, finish_reason, stats)
        held = [
            self._dump(self._chunk(choices=[ChatChunkChoice(index=index, delta=d)]))
            for d in self._deltas(index, None)
        ]
        return [*held, self.finish_chunk(index, finish_reason, stats)]

    def _deltas(self, index: int, text: str | None) -> list[ChatDelta]:
        """The parser's events for `text` (None: the end) as deltas; consecutive content pieces merge."""
        assert self._streams is not None
        stream = self._streams[index]
        events = stream.close() if text is None else stream.feed(text)
        deltas: list[ChatDelta] = []
        for event in events:
            if isinstance(event, TextDelta):
                if deltas and deltas[-1].content is not None:
                    deltas[-1].content += event.text
                else:
                    deltas.append(ChatDelta(content=event.text))
            elif isinstance(event, CallStart):
                call = ToolCallDelta(
                    index=event.index,
                    id=event.id,
                    type="function",
                    function=FunctionCallDelta(name=event.name, arguments=""),
                )
                deltas.append(ChatDelta(tool_calls=[call]))
            else:
                piece = FunctionCallDelta(arguments=event.arguments)
                deltas.append(ChatDelta(tool_calls=[ToolCallDelta(index=event.index, function=piece)]))
        return deltas

    def usage_chunk(self, stats: GenerationStats) -> dict:
        return self._dump(
            self._chunk(choices=[], usage=usage(stats), speculative=speculative_stats(self.plan, stats))
        )

    def _message(self, choice: ChoiceResult) -> tuple[AssistantMessage, str]:
        if self.tools is None:
            return AssistantMessage(content=choice.text), choice.finish_reason
        stream = self.tools.stream()  # a fresh parser: the whole text at once
        content, calls = collect([*stream.feed(choice.text), *stream.close()])
        finish_reason = self.tools.finish_reason(choice.finish_reason, called=bool(calls))
        return AssistantMessage(content=content, tool_calls=calls or None), finish_reason

    def response(self, results: list[PromptResult]) -> dict:
        choices = []
        for index, _, choice in self._choices(results):
            message, finish_reason = self._message(choice)
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=chat_logprobs(choice.tokens, choice.texts, choice.raw)
                    if self.wants_logprobs
                    else None,
                    finish_reason=finish_reason,  # type: ignore[arg-type]
                )
            )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage(request_stats(results)),
            speculative=self._speculative(results),
        ).model_dump(mode="json")
