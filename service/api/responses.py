"""Build OpenAI's response and stream-chunk shapes from the engine's events.

One formatter per endpoint: `CompletionFormatter` (object "text_completion") and `ChatFormatter`
("chat.completion" / "chat.completion.chunk", whose first chunk carries the assistant role).
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel

from service.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    FunctionCallDelta,
    ProvenanceToken,
    SpeculativeStats,
    SpeculativeTokens,
    ToolCallDelta,
    Usage,
)
from service.api.tools import CallStart, TextDelta, ToolPlan, collect
from service.api.worker import GenerationPlan, StepEvent
from service.decoding import GenerationStats


def usage(stats: GenerationStats) -> Usage:
    return Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
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


class Formatter:
    """What one request's responses share: id, creation time, model name, usage chunk or not."""

    id_prefix = "cmpl"

    def __init__(self, model: str, plan: GenerationPlan, include_usage: bool = False) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.plan = plan
        self.include_usage = include_usage

    def _dump(self, chunk: BaseModel) -> dict:
        # OpenAI sends "usage": null on every chunk but the last when include_usage is on, and no key when off.
        return chunk.model_dump(mode="json", exclude=None if self.include_usage else {"usage"})

    def opening_chunks(self) -> list[dict]:
        return []

    def step_chunk(self, event: StepEvent) -> dict | None:
        raise NotImplementedError

    def finish_chunk(self, finish_reason: str, stats: GenerationStats) -> dict:
        raise NotImplementedError

    def step_chunks(self, event: StepEvent) -> list[dict]:
        """What one round sends: usually its one chunk; tool calls may need more (OpenAI sends a call's
        name and its arguments as two deltas)."""
        chunk = self.step_chunk(event)
        return [] if chunk is None else [chunk]

    def finish_chunks(self, finish_reason: str, stats: GenerationStats) -> list[dict]:
        """The chunks that end the stream: held-back text or tool calls, then the finish chunk."""
        return [self.finish_chunk(finish_reason, stats)]

    def usage_chunk(self, stats: GenerationStats) -> dict:
        raise NotImplementedError

    def response(
        self, text: str, finish_reason: str, stats: GenerationStats, tokens: list[ProvenanceToken] | None
    ) -> dict:
        raise NotImplementedError

    def _step_speculative(self, event: StepEvent) -> SpeculativeTokens | None:
        if not self.plan.return_provenance:
            return None
        return SpeculativeTokens(tokens=provenance_tokens(event), draft_tokens=event.draft_tokens)

    def _wants_chunk(self, event: StepEvent) -> bool:
        # A round whose text is held back (half a character, a possible stop string) sends nothing, unless
        # the client asked for provenance: then the tokens go out as they are decided.
        return bool(event.text) or (self.plan.return_provenance and event.num_tokens > 0)


class CompletionFormatter(Formatter):
    id_prefix = "cmpl"

    def _chunk(self, **kwargs: object) -> CompletionChunk:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, **kwargs)  # type: ignore[arg-type]

    def step_chunk(self, event: StepEvent) -> dict | None:
        if not self._wants_chunk(event):
            return None
        choice = CompletionChoice(text=event.text, finish_reason=None)
        return self._dump(self._chunk(choices=[choice], speculative=self._step_speculative(event)))

    def finish_chunk(self, finish_reason: str, stats: GenerationStats) -> dict:
        choice = CompletionChoice(text="", finish_reason=finish_reason)  # type: ignore[arg-type]
        return self._dump(self._chunk(choices=[choice], speculative=speculative_stats(self.plan, stats)))

    def usage_chunk(self, stats: GenerationStats) -> dict:
        return self._dump(
            self._chunk(choices=[], usage=usage(stats), speculative=speculative_stats(self.plan, stats))
        )

    def response(
        self, text: str, finish_reason: str, stats: GenerationStats, tokens: list[ProvenanceToken] | None
    ) -> dict:
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason)],  # type: ignore[arg-type]
            usage=usage(stats),
            speculative=speculative_stats(self.plan, stats, tokens),
        ).model_dump(mode="json")


class ChatFormatter(Formatter):
    """With `tools` (a ToolPlan), the generated text goes through its tool-call parser: content and
    tool calls in the response, content and tool-call deltas in the stream."""

    id_prefix = "chatcmpl"

    def __init__(
        self, model: str, plan: GenerationPlan, include_usage: bool = False, tools: ToolPlan | None = None
    ) -> None:
        super().__init__(model, plan, include_usage)
        self.tools = tools
        self._stream = tools.stream() if tools is not None else None

    def _chunk(self, **kwargs: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, **kwargs)  # type: ignore[arg-type]

    def opening_chunks(self) -> list[dict]:
        delta = ChatDelta(role="assistant", content="")
        return [self._dump(self._chunk(choices=[ChatChunkChoice(delta=delta)]))]

    def step_chunk(self, event: StepEvent) -> dict | None:
        if not self._wants_chunk(event):
            return None
        choice = ChatChunkChoice(delta=ChatDelta(content=event.text))
        return self._dump(self._chunk(choices=[choice], speculative=self._step_speculative(event)))

    def finish_chunk(self, finish_reason: str, stats: GenerationStats) -> dict:
        if self.tools is not None and self._stream is not None:
            finish_reason = self.tools.finish_reason(finish_reason, called=self._stream.calls > 0)
        choice = ChatChunkChoice(delta=ChatDelta(), finish_reason=finish_reason)  # type: ignore[arg-type]
        return self._dump(self._chunk(choices=[choice], speculative=speculative_stats(self.plan, stats)))

    def step_chunks(self, event: StepEvent) -> list[dict]:
        if self._stream is None:
            return super().step_chunks(event)
        deltas = self._deltas(event.text)
        speculative = self._step_speculative(event)
        if speculative is not None and not deltas:  # provenance goes out as the tokens are decided
            deltas = [ChatDelta()]
        return [
            # the round's provenance rides on its first chunk
            self._dump(
                self._chunk(choices=[ChatChunkChoice(delta=d)], speculative=speculative if i == 0 else None)
            )
            for i, d in enumerate(deltas)
        ]

    def finish_chunks(self, finish_reason: str, stats: GenerationStats) -> list[dict]:
        if self._stream is None:
            return super().finish_chunks(finish_reason, stats)
        held = [self._dump(self._chunk(choices=[ChatChunkChoice(delta=d)])) for d in self._deltas(None)]
        return [*held, self.finish_chunk(finish_reason, stats)]

    def _deltas(self, text: str | None) -> list[ChatDelta]:
        """The parser's events for `text` (None: the end) as deltas; consecutive content pieces merge."""
        assert self._stream is not None
        events = self._stream.close() if text is None else self._stream.feed(text)
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

    def response(
        self, text: str, finish_reason: str, stats: GenerationStats, tokens: list[ProvenanceToken] | None
    ) -> dict:
        message = AssistantMessage(content=text)
        if self.tools is not None:
            stream = self.tools.stream()  # a fresh parser: the whole text at once
            content, calls = collect([*stream.feed(text), *stream.close()])
            message = AssistantMessage(content=content, tool_calls=calls or None)
            finish_reason = self.tools.finish_reason(finish_reason, called=bool(calls))
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChatChoice(message=message, finish_reason=finish_reason)],  # type: ignore[arg-type]
            usage=usage(stats),
            speculative=speculative_stats(self.plan, stats, tokens),
        ).model_dump(mode="json")
