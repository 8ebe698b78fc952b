"""The Responses API's output: the response object, its output items, and OpenAI's typed stream events.

`ResponseBuilder` builds one response's output items from its generated text, through the same tool-call
parser the chat endpoint uses: a `message` item for text, one `function_call` item per call. `feed`,
`finish` and `complete` return the events that text makes (`response.created`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`). `ResponsesFormatter` is the Responses API's
formatter over the one driver's events (`driver.py`): a stream sends the builder's events, the JSON answer
and a background response drop them and read `response()`.

A response's status (OpenAI's): `queued` (a background response waiting for the engine), `in_progress`,
then `completed`, `incomplete` (the token budget ran out), `failed` (with `error`) or `cancelled`.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from service.api.driver import Formatter, sse
from service.api.errors import APIError
from service.api.events import DoneEvent, GenerationPlan, RoundEvent
from service.api.formatters import request_speculative
from service.api.responses_api import FunctionTool, NamedFunction, ResponsesRequest, TextFormat
from service.api.results import Results
from service.api.schemas import (
    ChatMessage,
    FunctionCallParam,
    SpeculativeStats,
    ToolCallParam,
    _absent_if_none,
)
from service.api.tools import CallArguments, CallStart, TextDelta, ToolEvent, ToolPlan

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a response failed (OpenAI's `error` of a response: a code and a message)."""

    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction
    tools: list[FunctionTool]
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None
    metadata: dict[str, str]
    store: bool
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    speculative: SpeculativeStats | None = Field(None, exclude_if=_absent_if_none)


# ---------------------------------------------------------------- output items and stream events


class ResponseBuilder:
    """One response's output items, from its generated text; `feed` and `finish` return the stream events
    that text makes (the JSON answer ignores them and sends `response()`)."""

    def __init__(self, body: ResponsesRequest, model: str, tools: ToolPlan | None) -> None:
        self.body = body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self.tools = tools
        self._parser = tools.stream() if tools is not None else None
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._space = ""  # with tools: whitespace that may only separate calls, held until text follows
        self._sequence = 0
        self.status: Status = "queued" if body.background else "in_progress"
        self.error: ResponseError | None = None
        self.usage: ResponseUsage | None = None
        self.speculative: SpeculativeStats | None = None

    # ---- events
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **copy.deepcopy(fields)}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[ToolEvent] = self._parser.feed(text) if self._parser else [TextDelta(text)]
        return self._apply(events)

    def finish(self, finish_reason: str) -> list[dict[str, Any]]:
        """The generation finished: the held-back text or calls, and the last item closed."""
        out = self._apply(self._parser.close()) if self._parser else []
        incomplete = finish_reason == "length"
        if not self.items:  # no text and no call: still one (maybe empty) message
            out += self._open_message(self._space)
            self._space = ""
        out += self._close(incomplete)
        self.status = "incomplete" if incomplete else "completed"
        return out

    def complete(self, usage: ResponseUsage, speculative: SpeculativeStats) -> dict[str, Any]:
        """The response's last event, with its usage. `response.completed` also when the budget ran out (its
        response's status says "incomplete"), as vLLM does: the openai client's stream helper and the Agents
        SDK wait for that event alone."""
        self.usage, self.speculative = usage, speculative
        return self._event("response.completed", response=self.response())

    def error_event(self, error: APIError) -> dict[str, Any]:
        """OpenAI's `error` event: a stream that failed after it began ends with it."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    @property
    def running(self) -> bool:
        return self.status in ("queued", "in_progress")

    def stop(self, status: Literal["failed", "cancelled"], error: APIError | None = None) -> None:
        """End without a finish: the item being written stays in the output, marked incomplete."""
        self._close(incomplete=True)
        self.status = status
        if error is not None:
            self.error = ResponseError(code=error.code or "server_error", message=error.message)

    def _apply(self, events: list[ToolEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, TextDelta):
                out += self._text(event.text)
            elif isinstance(event, CallStart):
                out += self._close()
                self._space = ""  # whitespace between calls is no message
                item = {
                    "type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": event.id,
                    "name": event.name, "arguments": "", "status": "in_progress",
                }  # fmt: skip
                self._add(item)
                out.append(self._event("response.output_item.added", output_index=self._index, item=item))
            elif isinstance(event, CallArguments) and self._open is not None:
                self._open["arguments"] += event.arguments
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=self._index,
                        delta=event.arguments,
                    )  # fmt: skip
                )
        return out

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = item

    def _text(self, text: str) -> list[dict[str, Any]]:
        if self._open is not None and self._open["type"] == "message":
            self._open["content"][0]["text"] += text
            return [self._text_event("response.output_text.delta", delta=text)]
        if self.tools is not None and not text.strip():
            self._space += text
            return []
        out = self._close()
        text, self._space = self._space + text, ""
        return out + self._open_message(text)

    def _open_message(self, text: str) -> list[dict[str, Any]]:
        item = {
            "type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "in_progress",
            "role": "assistant", "content": [],
        }  # fmt: skip
        self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out = [self._event("response.output_item.added", output_index=self._index, item=item)]
        item["content"].append(part)
        out.append(self._text_event("response.content_part.added", part=part))
        if text:
            part["text"] = text
            out.append(self._text_event("response.output_text.delta", delta=text))
        return out

    def _text_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert self._open is not None
        extra = {"logprobs": []} if kind.startswith("response.output_text") else {}
        return self._event(
            kind, item_id=self._open["id"], output_index=self._index, content_index=0, **extra, **fields
        )

    def _close(self, incomplete: bool = False) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        out: list[dict[str, Any]] = []  # the events below name the item while it is still open
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._text_event("response.output_text.done", text=part["text"]))
            out.append(self._text_event("response.content_part.done", part=part))
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=self._index,
                    name=item["name"],
                    arguments=item["arguments"],
                )  # fmt: skip
            )
        self._open = None
        item["status"] = "incomplete" if incomplete else "completed"
        out.append(self._event("response.output_item.done", output_index=self.items.index(item), item=item))
        return out

    # ---- the response object
    def response(self) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text and body.text.format else TextFormat(type="text")
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=self.status,
            background=bool(body.background),
            error=self.error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if self.status == "incomplete"
            else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.model,
            output=[
                OutputMessage(**i) if i["type"] == "message" else OutputFunctionCall(**i) for i in self.items
            ]
            if self.status not in ("queued", "in_progress")
            else [],
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            temperature=body.temperature,
            top_p=body.top_p,
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            text={"format": fmt.model_dump(mode="json", by_alias=True, exclude_none=True)},
            truncation=body.truncation or "disabled",
            usage=self.usage,
            metadata=body.metadata or {},
            store=body.store,
            user=body.user,
            reasoning=body.reasoning.model_dump(mode="json") if body.reasoning is not None else None,
            speculative=self.speculative,
        ).model_dump(mode="json", by_alias=True)

    def conversation(self, before: list[ChatMessage]) -> list[ChatMessage]:
        """The conversation with this response's output as its last assistant turn (for the store)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [
            ToolCallParam(
                id=i["call_id"], function=FunctionCallParam(name=i["name"], arguments=i["arguments"])
            )
            for i in self.items
            if i["type"] == "function_call"
        ]
        turn = ChatMessage(
            role="assistant", content=text if text or not calls else None, tool_calls=calls or None
        )
        return [*before, turn]


# ---------------------------------------------------------------- the formatter


class ResponsesFormatter(Formatter):
    """The Responses API over the driver's events (`driver.py`): the builder's typed events in a stream, the
    response object as the JSON answer; a background response runs the same events and keeps the builder.
    `keep` is called once the response has finished, before its last event is sent (to store it)."""

    def __init__(self, builder: ResponseBuilder, plan: GenerationPlan, keep: Callable[[], None]) -> None:
        self.builder = builder
        self.plan = plan
        self.keep = keep

    def frame(self, chunk: dict, results: Results) -> bytes:
        return sse(chunk, event=chunk["type"])

    def opening_chunks(self) -> list[dict]:
        return self.builder.start()

    def round_chunks(self, event: RoundEvent) -> list[dict]:
        return self.builder.feed(event.text)

    def finish_chunks(self, event: DoneEvent) -> list[dict]:
        return self.builder.finish(event.finish_reason)

    def closing_chunks(self, results: Results) -> list[dict]:
        stats = results.totals()
        usage = ResponseUsage(
            input_tokens=stats.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=stats.cached_tokens),
            output_tokens=stats.completion_tokens,
            total_tokens=stats.prompt_tokens + stats.completion_tokens,
        )
        completed = self.builder.complete(usage, request_speculative(self.plan, results))
        self.keep()
        return [completed]

    def error_chunks(self, error: APIError) -> list[dict]:
        """OpenAI's `error` event; the response, where it was still running, ends `failed` with the error."""
        event = self.builder.error_event(error)
        if self.builder.running:
            self.builder.stop("failed", error)
        return [event]

    def response(self, results: Results) -> dict:
        (choice,) = results.prompts[0].choices
        self.builder.feed(choice.text)
        self.builder.finish(choice.finish_reason)
        self.closing_chunks(results)
        return self.builder.response()
