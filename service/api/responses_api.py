"""OpenAI's Responses API (`POST /v1/responses`): the request, and the request as a chat request.

A Responses request is turned into a `ChatCompletionRequest` (input items -> chat messages, `instructions`
-> a system message, function tools -> chat tools, `text.format` -> `response_format`,
`max_output_tokens` -> `max_completion_tokens`), so planning, tool-call parsing and structured output are
the chat endpoint's own (`plan.py`, `tools/`); errors found there are renamed back to the Responses
field they come from (`input.3`, `max_output_tokens`, `text.format`).

What OpenAI's request may hold and this server cannot honour is refused here with a 400 that names the
field (`refusal`): reasoning effort and summaries (the served models do not reason), logprobs, a stored
prompt or conversation object, background mode without the store. The fields accepted and ignored are
listed in docs/openai-api.md, with these.

The output side is `responses_output.py` (the response object, its items and stream events), the store
of responses `response_store.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from service.api.errors import INCONSISTENT, APIError, bad_request, unsupported
from service.api.response_store import ResponseStore, StoredResponse
from service.api.schemas import (
    TOOL_NAME_PATTERN,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallParam,
    FunctionDefinition,
    JsonSchemaFormat,
    ResponseFormat,
    SpeculativeOptions,
    Tool,
    ToolCallParam,
    _Request,
    object_schema,
)

__all__ = ["ResponseStore", "StoredResponse"]  # app.py builds the store from here

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


def _json_schema_needs_name_and_schema(schema: dict[str, Any]) -> None:
    """OpenAPI only (`chat_form` refuses it with `inconsistent_parameters`): a `json_schema` format has a
    name and a schema, as OpenAI's has."""
    schema["anyOf"] = [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {
            "properties": {
                "type": {"const": "json_schema"},
                "name": {"type": "string"},
                "schema": {"type": "object"},
            },
            "required": ["name", "schema"],
        },
    ]


class TextFormat(_Request):
    model_config = ConfigDict(json_schema_extra=_json_schema_needs_name_and_schema)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(
        None, pattern=TOOL_NAME_PATTERN, description="json_schema: the schema's name (a-z, A-Z, 0-9, _, -)"
    )
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="json_schema: a JSON Schema")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced exactly")


class TextOptions(_Request):
    format: TextFormat | None = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
ReasoningSummary = Literal["auto", "concise", "detailed"]


class ReasoningOptions(_Request):
    """OpenAI's reasoning options. The served models do not reason: only "no reasoning" is honoured."""

    effort: ReasoningEffort | None = Field(None, description="'none' or null only: the model does not reason")
    summary: ReasoningSummary | None = Field(None, description="not supported (no reasoning to summarise)")
    generate_summary: ReasoningSummary | None = Field(None, description="not supported (summary's old name)")


# OpenAI's `include` values. Those naming items this server never makes (hosted tools' results, input
# images, reasoning) are honoured by having nothing to add; logprobs are not supported.
Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


class ResponsesRequest(_Request):
    model: str = Field(description="the served model id (see GET /v1/models)")
    input: Annotated[
        Annotated[str, Field(min_length=1), Tag("str")]
        | Annotated[list[InputItem], Field(min_length=1), Tag("list[...]")],
        Discriminator(_str_or_list),
    ] = Field(description="text (one user message), or a list of messages, function calls and their outputs")
    instructions: str | None = Field(None, description="a system message before the input (not carried over)")
    previous_response_id: str | None = Field(
        None,
        min_length=1,
        description="continue a stored response's conversation (this server keeps the latest ones)",
    )
    max_output_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    background: bool | None = Field(
        None,
        description="answer at once with the response queued, generate after; poll GET /v1/responses/{id}, "
        "stop with POST /v1/responses/{id}/cancel (needs store: true; not with stream: true)",
    )
    tools: list[FunctionTool] | None = Field(None, description="function tools the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = Field(None, description="text.format: text, json_object or json_schema")
    store: bool = Field(
        True, description="keep the response for GET /v1/responses/{id} and previous_response_id"
    )
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="nothing is truncated: a conversation over the context is refused with either"
    )
    reasoning: ReasoningOptions | None = Field(
        None, description="effort 'none' only: the model does not reason"
    )
    include: list[Includable] | None = Field(None, description="every value but message.output_text.logprobs")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="not supported (0 or null only)")
    conversation: Any = Field(None, description="not supported (send previous_response_id or the input)")
    prompt: Any = Field(None, description="not supported (a stored prompt template)")
    context_management: Any = Field(None, description="not supported (nothing is compacted)")
    speculative: SpeculativeOptions | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, what) for the first field set to something this server cannot honour, or None."""
        reasoning = self.reasoning
        if reasoning is not None:
            if reasoning.effort not in (None, "none"):
                return (
                    "reasoning.effort",
                    f"reasoning effort {reasoning.effort!r} (the model does not reason)",
                )
            for name in ("summary", "generate_summary"):
                if getattr(reasoning, name) is not None:
                    return f"reasoning.{name}", f"reasoning.{name} (the model does not reason)"
        if self.include is not None and "message.output_text.logprobs" in self.include:
            return "include", "include 'message.output_text.logprobs' (logprobs on the Responses API)"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs (logprobs on the Responses API)"
        for name, what in (
            ("conversation", "conversation (the Conversations API; send previous_response_id or the input)"),
            ("prompt", "prompt (stored prompt templates)"),
            ("context_management", "context_management (compaction)"),
        ):
            if getattr(self, name):
                return name, what
        if self.background and self.stream:
            return "background", "background together with stream: true (poll GET /v1/responses/{id})"
        return None


def refusal(body: ResponsesRequest, store: ResponseStore) -> APIError | None:
    """Why this server refuses the request before any work on it, or None."""
    refused = body.unsupported_field()
    if refused is not None:
        return unsupported(*refused)
    if body.background and not body.store:
        return bad_request(
            "background: true needs store: true (the response is stored to be polled)",
            param="store",
            code=INCONSISTENT,
        )
    if body.background and store.max_items == 0:
        return unsupported(
            "background", "background (this server stores no response: CSD_RESPONSES_STORE_SIZE=0)"
        )
    return None


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
            if fmt.schema_ is None:
                raise bad_request(
                    "text.format of type json_schema needs a schema",
                    param="text.format.schema",
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
