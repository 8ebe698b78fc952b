"""Build OpenAI's response and stream-chunk shapes from the engine's events.

Two formatters over the driver's events (`driver.py`; the Responses API's is in `responses_output.py`):
`CompletionFormatter` (object "text_completion") and `ChatFormatter` ("chat.completion" /
"chat.completion.chunk", whose first chunk of each choice carries the assistant role). They read a request's
`Results` (`results.py`), which the driver gathered: one per prompt (completions may send a batch), n choices
each, numbered prompt by prompt as OpenAI and vLLM do.

Logprobs: the chat shape (`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`) and the legacy
completions shape (parallel `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists, whose
top dictionaries always hold the chosen token, as vLLM's do). A token's text is its own decoding.
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel

from service.api.driver import DONE, Formatter, sse
from service.api.errors import APIError
from service.api.events import DoneEvent, GenerationPlan, PromptEvent, RoundEvent
from service.api.results import ChoiceResult, PromptResult, Results, provenance_tokens
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
from service.decoding.types import EmittedToken


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


class ChunkFormatter(Formatter):
    """What chat and completions share: id, creation time, model name, `data: {chunk}` events ended by
    `data: [DONE]`, an error as a last `data: {"error": ...}` event, the usage chunk or not."""

    id_prefix = "cmpl"
    end_of_stream = DONE

    def __init__(
        self, model: str, plan: GenerationPlan, include_usage: bool = False, continuous_usage: bool = False
    ) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.plan = plan
        self.include_usage = include_usage
        # vLLM's continuous_usage_stats: every chunk carries the usage so far
        self.continuous_usage = include_usage and continuous_usage

    def frame(self, chunk: dict, results: Results) -> bytes:
        """A chunk as its event; with continuous usage, the usage so far on it (unless it has its own, or is
        the error that ends a failed stream)."""
        if self.continuous_usage and chunk.get("usage") is None and "error" not in chunk:
            prompt, generated = len(self.plan.prompt_ids), results.generated
            chunk["usage"] = Usage(
                prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated
            ).model_dump(mode="json")
        return sse(chunk)

    @property
    def wants_logprobs(self) -> bool:
        return self.plan.sampling.logprobs is not None

    def _dump(self, chunk: BaseModel) -> dict:
        # OpenAI sends "usage": null on every chunk but the last when include_usage is on, and no key when off.
        return chunk.model_dump(mode="json", exclude=None if self.include_usage else {"usage"})

    def _chunk(self, **kwargs: object) -> BaseModel:
        raise NotImplementedError

    def round_chunk(self, event: RoundEvent) -> dict | None:
        raise NotImplementedError

    def finish_chunk(self, index: int, finish_reason: str, stats: GenerationStats) -> dict:
        raise NotImplementedError

    def round_chunks(self, event: RoundEvent) -> list[dict]:
        """What one round sends: usually its one chunk; tool calls may need more (OpenAI sends a call's
        name and its arguments as two deltas)."""
        chunk = self.round_chunk(event)
        return [] if chunk is None else [chunk]

    def finish_chunks(self, event: DoneEvent) -> list[dict]:
        """The chunks that end a choice: held-back text or tool calls, then its finish chunk."""
        return [self.finish_chunk(event.index, event.finish_reason, event.stats)]

    def closing_chunks(self, results: Results) -> list[dict]:
        if not self.include_usage:
            return []
        stats = results.totals()
        return [
            self._dump(
                self._chunk(choices=[], usage=usage(stats), speculative=speculative_stats(self.plan, stats))
            )
        ]

    def error_chunks(self, error: APIError) -> list[dict]:
        return [error.body()]

    def _round_speculative(self, event: RoundEvent) -> SpeculativeTokens | None:
        if not self.plan.return_provenance:
            return None
        return SpeculativeTokens(tokens=provenance_tokens(event), draft_tokens=event.draft_tokens)

    def _wants_chunk(self, event: RoundEvent) -> bool:
        # A round whose text is held back (half a character, a possible stop string) sends nothing, unless
        # the client asked for provenance or logprobs: then the tokens go out as they are decided.
        asked = self.plan.return_provenance or self.wants_logprobs
        return bool(event.text) or (asked and event.num_tokens > 0)


def request_speculative(plan: GenerationPlan, results: Results) -> SpeculativeStats:
    """A finished request's speculative statistics, with every token's provenance when it asked."""
    provenance = results.provenance() if plan.return_provenance else None
    return speculative_stats(plan, results.totals(), provenance)


class CompletionFormatter(ChunkFormatter):
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

    def round_chunk(self, event: RoundEvent) -> dict | None:
        if not self._wants_chunk(event):
            return None
        logprobs = None
        if event.logprob_texts is not None:
            offset = self._offsets[event.index]
            logprobs = completion_logprobs(_emitted_entries(event.tokens), event.logprob_texts, offset)
            self._offsets[event.index] = offset + sum(len(t) for t in logprobs.tokens)
        choice = CompletionChoice(index=event.index, text=event.text, logprobs=logprobs, finish_reason=None)
        return self._dump(self._chunk(choices=[choice], speculative=self._round_speculative(event)))

    def finish_chunk(self, index: int, finish_reason: str, stats: GenerationStats) -> dict:
        choice = CompletionChoice(index=index, text="", finish_reason=finish_reason)  # type: ignore[arg-type]
        return self._dump(self._chunk(choices=[choice], speculative=speculative_stats(self.plan, stats)))

    def response(self, results: Results) -> dict:
        choices = []
        for index, result, choice in results.choices:
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
            usage=usage(results.totals()),
            speculative=request_speculative(self.plan, results),
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


class ChatFormatter(ChunkFormatter):
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

    def round_chunk(self, event: RoundEvent) -> dict | None:
        if not self._wants_chunk(event):
            return None
        choice = ChatChunkChoice(
            index=event.index, delta=ChatDelta(content=event.text), logprobs=self._logprobs(event)
        )
        return self._dump(self._chunk(choices=[choice], speculative=self._round_speculative(event)))

    def _logprobs(self, event: RoundEvent) -> ChatLogprobs | None:
        if event.logprob_texts is None:
            return None
        return chat_logprobs(event.tokens, event.logprob_texts, event.logprob_bytes or {})

    def finish_chunk(self, index: int, finish_reason: str, stats: GenerationStats) -> dict:
        if self.tools is not None and self._streams is not None:
            finish_reason = self.tools.finish_reason(finish_reason, called=self._streams[index].calls > 0)
        choice = ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish_reason)  # type: ignore[arg-type]
        return self._dump(self._chunk(choices=[choice], speculative=speculative_stats(self.plan, stats)))

    def round_chunks(self, event: RoundEvent) -> list[dict]:
        if self._streams is None:
            return super().round_chunks(event)
        deltas = self._deltas(event.index, event.text)
        speculative, logprobs = self._round_speculative(event), self._logprobs(event)
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

    def finish_chunks(self, event: DoneEvent) -> list[dict]:
        if self._streams is None:
            return super().finish_chunks(event)
        index = event.index
        held = [
            self._dump(self._chunk(choices=[ChatChunkChoice(index=index, delta=d)]))
            for d in self._deltas(index, None)
        ]
        return [*held, self.finish_chunk(index, event.finish_reason, event.stats)]

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

    def _message(self, choice: ChoiceResult) -> tuple[AssistantMessage, str]:
        if self.tools is None:
            return AssistantMessage(content=choice.text), choice.finish_reason
        stream = self.tools.stream()  # a fresh parser: the whole text at once
        content, calls = collect([*stream.feed(choice.text), *stream.close()])
        finish_reason = self.tools.finish_reason(choice.finish_reason, called=bool(calls))
        return AssistantMessage(content=content, tool_calls=calls or None), finish_reason

    def response(self, results: Results) -> dict:
        choices = []
        for index, _, choice in results.choices:
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
            usage=usage(results.totals()),
            speculative=request_speculative(self.plan, results),
        ).model_dump(mode="json")
