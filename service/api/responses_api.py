"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat-completions machinery.

A Responses request is turned into a `ChatCompletionRequest` (input items -> chat messages, `instructions`
-> a system message, function tools -> chat tools, `text.format` -> `response_format`,
`max_output_tokens` -> `max_completion_tokens`), so planning, tool-call parsing and structured output are
the chat endpoint's own (`plan.py`, `tools.py`); errors found there are renamed back to the Responses
field they come from (`input.3`, `max_output_tokens`, `text.format`).

Output is built by `ResponseBuilder` from the generated text, through the same tool-call parser the chat
endpoint uses: a `message` item for text, one `function_call` item per call, and, streaming, OpenAI's
typed events (`response.created`, `response.output_item.added`, `response.output_text.delta`, ...,
`response.completed`). `previous_response_id` continues a stored conversation: `ResponseStore` keeps the
last `responses_store_size` conversations in memory (least recently used out first).
"""

from __future__ import annotations

import collections
import copy
import re
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, field_validator

from service.api.errors import INCONSISTENT, PREVIOUS_RESPONSE_NOT_FOUND, APIError, bad_request
from service.api.schemas import (
    TOOL_NAME_PATTERN,
    ChatCompletionRequest,
    ChatMessage,
    ErrorDetail,
    FunctionCallParam,
    FunctionDefinition,
    JsonSchemaFormat,
    ResponseFormat,
    SpeculativeOptions,
    SpeculativeStats,
    Tool,
    ToolCallParam,
    _absent_if_none,
    _Request,
    object_schema,
)
from service.api.tools import CallArguments, CallStart, TextDelta, ToolEvent, ToolPlan

# ---------------------------------------------------------------- the request


class TextPart(_Request):
    """A text part of a message: `input_text` (user, system) or `output_text` (an earlier assistant turn)."""

    type: Literal["input_text", "output_text"]
    text: str


def _str_or_list(value: Any) -> str:
    return "str" if isinstance(value, str) else "list[...]"


# Text or a list of parts; the discriminator makes a list's errors those of a list, not also "not a string"
# (its tags hold brackets, so error locations leave them out: errors.py).
TextOrParts = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[TextPart], Tag("list[...]")], Discriminator(_str_or_list)
]


class MessageItem(_Request):
    type: Literal["message"] | None = Field(None, description="'message' (may be left out)")
    role: Literal["user", "assistant", "system", "developer"]
    content: TextOrParts = Field(description="text, or a list of text parts")

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(_Request):
    """A call the model made in an earlier turn (as a response's `output` gave it)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string")
    id: str | None = None


class FunctionCallOutputItem(_Request):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, description="the call_id of the function_call it answers")
    output: TextOrParts

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type")
        return "message" if kind is None and "role" in value else kind
    return getattr(value, "type", None) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(_Request):
    """A function tool, in the Responses shape (flat: `name` beside `type`). Only function tools: a
    hosted tool (web_search, file_search, ...) is refused at `type`."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON Schema of the arguments object (absent: no arguments)"
    )
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return object_schema(value)


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64, description="json_schema: the schema's name")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="json_schema: a JSON Schema")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced exactly")


class TextOptions(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str = Field(description="the served model id (see GET /v1/models)")
    input: Annotated[
        Annotated[str, Tag("str")] | Annotated[list[InputItem], Field(min_length=1), Tag("list[...]")],
        Discriminator(_str_or_list),
    ] = Field(description="text (one user message), or a list of messages, function calls and their outputs")
    instructions: str | None = Field(None, description="a system message before the input (not carried over)")
    previous_response_id: str | None = Field(
        None, description="continue a stored response's conversation (this server keeps the latest ones)"
    )
    max_output_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, description="function tools the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = Field(None, description="text.format: text, json_object or json_schema")
    store: bool = Field(True, description="keep the response for previous_response_id")
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = Field(None, description="accepted; never truncates")
    speculative: SpeculativeOptions | None = None


# ---------------------------------------------------------------- the response


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


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: ErrorDetail | None = None
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
    speculative: SpeculativeStats | None = Field(None, exclude_if=_absent_if_none)


# ---------------------------------------------------------------- request -> chat request


@dataclass
class ChatForm:
    """A Responses request as a chat request, with where each chat message came from (for errors)."""

    chat: ChatCompletionRequest
    origins: list[str]  # per chat message: the Responses field it came from ("input.2", "instructions")
    conversation: list[ChatMessage]  # the messages to store (without instructions)


def _messages(items: list[Any], origin: str | None) -> tuple[list[ChatMessage], list[str]]:
    """Input items -> chat messages: consecutive function calls join the assistant turn before them."""
    messages: list[ChatMessage] = []
    origins: list[str] = []
    for i, item in enumerate(items):
        where = origin or f"input.{i}"
        if isinstance(item, FunctionCallItem):
            call = ToolCallParam(
                id=item.call_id, function=FunctionCallParam(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                calls = [*(last.tool_calls or ()), call]
                messages[-1] = ChatMessage(role="assistant", content=last.content, tool_calls=calls)
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
                origins.append(where)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=item.text, tool_call_id=item.call_id))
            origins.append(where)
        else:
            messages.append(ChatMessage(role=item.role, content=item.text))
            origins.append(where)
    return messages, origins


def chat_form(body: ResponsesRequest, history: list[ChatMessage]) -> ChatForm:
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    try:
        new, origins = _messages(list(items), "input" if isinstance(body.input, str) else None)
    except ValidationError as exc:
        raise bad_request(f"input: {exc.errors()[0]['msg']}", param="input") from None
    conversation = [*history, *new]
    origins = ["previous_response_id"] * len(history) + origins
    messages = conversation
    if body.instructions is not None:
        messages = [ChatMessage(role="system", content=body.instructions), *conversation]
        origins = ["instructions", *origins]
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "speculative": body.speculative,
        "user": body.user,
    }
    if body.tools is not None:
        chat["tools"] = [
            Tool(type="function", function=FunctionDefinition(**tool.model_dump(exclude={"type"})))
            for tool in body.tools
        ]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    else:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            chat["response_format"] = ResponseFormat(type="json_object")
        else:
            if not fmt.name:
                raise bad_request(
                    "text.format of type json_schema needs a name",
                    param="text.format.name",
                    code=INCONSISTENT,
                )
            schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
            chat["response_format"] = ResponseFormat(type="json_schema", json_schema=schema)
    try:
        request = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # a rule of the chat shape the Responses schema does not state
        error = exc.errors()[0]
        loc = [str(p) for p in error.get("loc", ())]
        param = "input"
        if loc and loc[0] == "messages" and len(loc) > 1 and loc[1].isdigit():
            param = origins[int(loc[1])]
        raise bad_request(f"{param}: {error['msg'].removeprefix('Value error, ')}", param=param) from None
    return ChatForm(request, origins, conversation)


_RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
    "prompt": "input",
    "messages": "input",
}
_MESSAGE_PARAM = re.compile(r"^messages\.(\d+)(.*)$")


def renamed(error: APIError, origins: list[str]) -> APIError:
    """A chat-shaped error, naming the Responses field instead (in its param and its message)."""
    param = error.param
    if param is None:
        return error
    match = _MESSAGE_PARAM.match(param)
    if match:
        index = int(match.group(1))
        new = origins[index] if index < len(origins) else "input"
        error.message = error.message.replace(f"messages.{index}", new)
        error.param = new
    elif param in _RENAMED:
        error.param = _RENAMED[param]
        error.message = error.message.replace(param, _RENAMED[param])
    return error


# ---------------------------------------------------------------- the store


@dataclass
class StoredResponse:
    conversation: list[ChatMessage]  # every message up to and including the response's own output


class ResponseStore:
    """The latest responses' conversations, for `previous_response_id`; at most `max_items` of them (least
    recently used first out). In memory: one replica's, gone at restart (say so to clients: a missing id
    is a 400 naming previous_response_id)."""

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_items == 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def conversation(self, response_id: str) -> list[ChatMessage]:
        stored = self._items.get(response_id)
        if stored is None:
            kept = f"the latest {self.max_items}" if self.max_items else "none (CSD_RESPONSES_STORE_SIZE=0)"
            raise bad_request(
                f"no stored response has the id {response_id!r}: this server keeps {kept} in memory, "
                "and only those created with store: true",
                param="previous_response_id",
                code=PREVIOUS_RESPONSE_NOT_FOUND,
            )
        self._items.move_to_end(response_id)
        return list(stored.conversation)


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
        self.status = "in_progress"
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

    def finish(self, finish_reason: str, usage: ResponseUsage, speculative: SpeculativeStats) -> list[dict]:
        out = self._apply(self._parser.close()) if self._parser else []
        incomplete = finish_reason == "length"
        if not self.items:  # no text and no call: still one (maybe empty) message
            out += self._open_message(self._space)
            self._space = ""
        out += self._close(incomplete)
        self.status = "incomplete" if incomplete else "completed"
        self.usage, self.speculative = usage, speculative
        # response.completed also when the budget ran out (its response's status says "incomplete"), as
        # vLLM does: the openai client's stream helper and the Agents SDK wait for that event alone.
        return [*out, self._event("response.completed", response=self.response())]

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
            status=self.status,  # type: ignore[arg-type]
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if self.status == "incomplete"
            else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.model,
            output=[
                OutputMessage(**i) if i["type"] == "message" else OutputFunctionCall(**i) for i in self.items
            ]
            if self.status != "in_progress"
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
