"""Request and response bodies, with OpenAI's field names and shapes.

Requests are validated strictly (a string is not a number, a number is not a string): a wrong type is a 400
naming the field. Unknown top-level fields are ignored, as vLLM does, so newer clients keep working; fields
we know but do not support (audio, predicted outputs, ...) are refused by `unsupported_field()` with a 400
that names them. The `speculative` extension object is ours, so it refuses unknown keys (typos). vLLM's
extra sampling parameters (`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`structured_outputs`) are accepted where OpenAI has none.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.decoding.drafter_registry import DrafterName, describe_drafters

FinishReason = Literal["stop", "length", "tool_calls"]
MethodName = Literal["vanilla", "sd", "lossy", "csd"]
ProvenanceName = Literal["accepted", "rescued", "recovered", "bonus", "plain"]

# A token id; the model's vocabulary size bounds it too (checked per request, where the model is known).
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
MAX_STOP_SEQUENCES = 16
MAX_CHOICES = 16  # n: choices share the batch, whose default size is 16
MAX_PROMPTS = 16  # prompts in one completions batch
MAX_LOGPROBS = 20


@cache
def _integer_fields(model: type[BaseModel]) -> frozenset[str]:
    """Names (and aliases) of the fields that take an integer and no float."""
    names = set()
    for name, info in model.model_fields.items():
        args = set(get_args(info.annotation)) | {info.annotation}
        if int in args and float not in args:
            names.update({name, info.alias or name})
    return frozenset(names)


def _non_empty_strings(schema: dict[str, Any]) -> None:
    """OpenAPI only (the server's own check, in plan.py, keeps its clearer message): the strings of this
    union, alone or in a list, must not be empty, as the server requires."""
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == "string":
            option["minLength"] = 1
        elif option.get("items", {}).get("type") == "string":
            option["items"]["minLength"] = 1


def _non_empty_prompt(schema: dict[str, Any]) -> None:
    """OpenAPI only: no empty prompt, neither an empty string nor an empty list."""
    _non_empty_strings(schema)
    for option in schema.get("anyOf", []):
        if option.get("type") == "array":
            option["minItems"] = 1
            items = option.get("items", {})
            if items.get("type") in ("array", "string"):  # a batch of prompts (a list of ids is one prompt)
                option["maxItems"] = MAX_PROMPTS
            if items.get("type") == "array":
                items["minItems"] = 1


def _text_parts(schema: dict[str, Any]) -> None:
    """OpenAPI only: a list of content parts holds text parts (what `_text_parts_only` accepts)."""
    part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    for option in schema.get("anyOf", []):
        if option.get("type") == "array":
            option["items"] = part


# fields holding (lists of) token ids: whole floats inside them are integers too
TOKEN_ID_LISTS = frozenset({"prompt", "stop_token_ids", "tokens"})


def _integral_ids(value: object) -> object:
    if isinstance(value, list):
        return [_integral_ids(v) for v in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _token_id_keys(schema: dict[str, Any]) -> None:
    """OpenAPI only: pydantic states the key rule as `patternProperties` but leaves other keys allowed;
    only token ids are keys."""
    for option in schema.get("anyOf", [schema]):
        if "patternProperties" in option:
            option["additionalProperties"] = False


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats_are_integers(cls, data: object) -> object:
        """JSON has one number type: 5.0 is the integer 5 (JSON Schema's `integer` says so, and Python's
        json module writes whole floats that way). Strict mode would refuse it for an int field; a string
        stays refused."""
        if not isinstance(data, dict):
            return data
        fields = _integer_fields(cls)
        return {
            k: int(v)
            if k in fields and isinstance(v, float) and v.is_integer()
            else _integral_ids(v)
            if k in TOKEN_ID_LISTS
            else v
            for k, v in data.items()
        }


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="add a last chunk with `usage` (and `speculative`)")
    continuous_usage_stats: bool = Field(
        False, description="with include_usage: every chunk carries the usage so far (vLLM's)"
    )


class SpeculativeOptions(_Request):
    """Per-request overrides of the server's speculation defaults (a csd-serve extension)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    method: MethodName | None = Field(None, description="vanilla | sd (lossless) | lossy | csd")
    drafter: DrafterName | None = Field(None, description=describe_drafters())
    num_speculative_tokens: int | None = Field(None, ge=0, le=64, description="draft tokens per round")
    tau: float | None = Field(
        None, gt=0, le=1, description="CSD semantic gate: p(draft)/p(target top) >= tau"
    )
    lambda_: float | None = Field(
        None, ge=0, alias="lambda", description="CSD frequency gate: rescue when count > lambda"
    )
    guard_facts: bool | None = Field(
        None, description="csd: never rescue numbers, negations or names (server default: on)"
    )
    return_provenance: bool = Field(
        False, description="return each token's provenance (accepted, rescued, recovered, bonus, plain)"
    )


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced exactly")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's structured-output parameters: exactly one of them."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON Schema")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect) or GBNF")
    json_object: bool | None = None


class _GenerationRequest(_Request):
    model: str = Field(description="the served model id (see GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy (the server default)")
    top_p: float | None = Field(None, gt=0, le=1)
    # any integer, used modulo 2^64 (torch's generator takes 64 bits, and maps a negative seed s to s + 2^64
    # itself). A bound of 2^64 - 1 in the schema read as a double is 2^64, which clients generating from the
    # schema (schemathesis did) then sent and had refused
    seed: int | None = Field(None, description="any integer; used modulo 2^64")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = Field(
        None, json_schema_extra=_non_empty_strings
    )
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices (they share one prompt prefill)")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100]", json_schema_extra=_token_id_keys
    )
    # vLLM's extra sampling parameters
    repetition_penalty: float | None = Field(None, ge=0.01, le=2, description="1: none (vLLM's extra)")
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_limit(cls, value: object) -> object:
        # Checked before the str | list union, whose first member would report "a valid string" instead.
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(value)}")
        return value

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, what) for the first field set to something we cannot honour, or None."""
        rf = self.response_format
        if self.structured_outputs is not None and rf is not None and rf.type != "text":
            return "structured_outputs", "structured_outputs together with a response_format"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options without stream: true"
        return None

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: continuous_usage_stats counts only together with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def requested_max_tokens(self) -> int | None:
        """The token budget the request asks for (chat requests may name it max_completion_tokens)."""
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field an error about the budget names."""
        return "max_tokens"


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        json_schema_extra=_non_empty_prompt,
        description="the prompt: text, token ids, or a batch of either (one choice set per prompt)",
    )
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate at most; 0 with echo scores")
    echo: bool | None = Field(None, description="return the prompt before the completion")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top alternatives per token")
    best_of: int | None = Field(None, description="not supported (only 1)")
    suffix: str | None = Field(None, description="not supported")

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1, self.n):
            return "best_of", "best_of other than n (server-side ranking of choices)"
        if self.suffix is not None:
            return "suffix", "suffix"
        return super().unsupported_field()


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionCallParam(_Request):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string (OpenAI's shape)")


class ToolCallParam(_Request):
    """A tool call in the history: an earlier assistant turn's `tool_calls` entry."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class FunctionDefinition(_Request):
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


def object_schema(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's rule for a function's parameters: the arguments are always a JSON object."""
    if value is not None and value.get("type", "object") != "object":
        raise ValueError(f"must be a JSON Schema of type 'object', got type {value.get('type')!r}")
    return value


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


def _message_shapes(schema: dict[str, Any]) -> None:
    """The per-role rules of `_fields_of_the_role` in the OpenAPI document too (OpenAI's spec has one message
    type per role), so that clients and generated requests see which fields each role needs."""
    part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    text = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    schema["properties"].pop("function_call", None)  # the legacy field is refused: not documented
    schema["anyOf"] = [
        {
            "properties": {
                "role": {"enum": ["system", "developer", "user"]},
                "content": text,
                "tool_calls": False,
            },
            "required": ["role", "content"],
        },
        {
            "properties": {"role": {"const": "assistant"}, "content": text},
            "required": ["role", "content"],
        },
        {
            "properties": {
                "role": {"const": "assistant"},
                "content": {"anyOf": [*text["anyOf"], {"type": "null"}]},
                "tool_calls": {"type": "array", "minItems": 1},
            },
            "required": ["role", "tool_calls"],
        },
        {
            "properties": {
                "role": {"const": "tool"},
                "content": text,
                "tool_call_id": {"type": "string", "minLength": 1},
                "tool_calls": False,
            },
            "required": ["role", "content", "tool_call_id"],
        },
    ]


class ChatMessage(_Request):
    # merged with the base class's config (strict, extra="ignore", ...)
    model_config = ConfigDict(json_schema_extra=_message_shapes)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = Field(
        None, description="text, or a list of text parts (null for an assistant turn with tool_calls)"
    )
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="assistant: the tools it called")
    tool_call_id: str | None = Field(None, description="tool: the call this message answers")
    function_call: Any = Field(None, description="not supported (the legacy API: send tool_calls)")

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.function_call is not None:
            raise ValueError(
                "function_call is the legacy function-calling API, not supported: send tool_calls"
            )
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant turn with tool_calls may omit it)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        return self

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got type {kind!r}")
                TextContentPart.model_validate(part)
        return value

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")
    logprobs: bool | None = Field(None, description="return the log-probability of each output token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives per token")
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none | auto (the default with tools) | required | {type: function, function: {name}}",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call (default true)")
    functions: list[Any] | None = Field(None, description="not supported (the legacy API: send tools)")
    function_call: Any = Field(None, description="not supported (the legacy API: send tool_choice)")
    modalities: list[str] | None = Field(None, description="only ['text']")
    audio: Any = Field(None, description="not supported")
    prediction: Any = Field(None, description="not supported")

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_tool_choice(cls, value: object) -> object:
        # Checked by hand: the union's own errors would list every member's complaint, for either shape.
        expected = '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            function = value.get("function")
            if (
                value.get("type") == "function"
                and isinstance(function, dict)
                and isinstance(function.get("name"), str)
            ):
                return NamedToolChoice(type="function", function=FunctionName(name=function["name"]))
        raise ValueError(f"must be {expected}")

    def unsupported_field(self) -> tuple[str, str] | None:
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                return name, f"{name} (the legacy function-calling API; send tools and tool_choice instead)"
        for name in ("audio", "prediction"):
            if getattr(self, name):
                return name, f"{name} (audio, predicted outputs)"
        if self.modalities is not None and set(self.modalities) - {"text"}:
            return "modalities", "output modalities other than text"
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            return "max_tokens", "max_tokens together with a different max_completion_tokens"
        return super().unsupported_field()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# ---------------------------------------------------------------- responses


def _absent_if_none(value: object) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        0, description="prompt tokens served from the prefix cache (their keys and values were not computed)"
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's shape; absent (not 0) where it is not known yet: the usage so far of continuous_usage_stats
    prompt_tokens_details: PromptTokensDetails | None = Field(None, exclude_if=_absent_if_none)


class ProvenanceToken(BaseModel):
    id: int
    text: str
    provenance: ProvenanceName
    replaced_id: int | None = Field(None, exclude_if=_absent_if_none, description="rescued: target's top")
    replaced_text: str | None = Field(None, exclude_if=_absent_if_none)


class SpeculativeStats(BaseModel):
    """How the generation speculated (a csd-serve extension, next to `usage`)."""

    method: MethodName
    drafter: str | None = Field(description="null when the method does not speculate")
    num_speculative_tokens: int
    draft_tokens: int
    accepted_tokens: int
    rescued_tokens: int
    recovered_tokens: int
    bonus_tokens: int
    acceptance_rate: float = Field(
        description="accepted / draft tokens (strict: rescued tokens not included)"
    )
    kept_rate: float = Field(description="(accepted + rescued) / draft tokens")
    rescue_rate: float = Field(description="rescued / draft tokens")
    tokens_per_forward: float = Field(description="tokens per target forward (vLLM's mean acceptance length)")
    target_forwards: int
    forced_tokens: int = Field(
        0, description="structured output: draft tokens the grammar forced (jump-forward)"
    )
    tokens: list[ProvenanceToken] | None = Field(
        None, exclude_if=_absent_if_none, description="with return_provenance"
    )


class SpeculativeTokens(BaseModel):
    """The provenance of a stream chunk's tokens (with `speculative.return_provenance`)."""

    tokens: list[ProvenanceToken]
    draft_tokens: int = Field(0, description="draft tokens this round verified (for live acceptance rates)")


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (None for the prompt's first)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative: SpeculativeStats
    system_fingerprint: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object, in a string")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the turn is only tool calls")
    refusal: None = None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent_if_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: SpeculativeStats
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative: SpeculativeStats | SpeculativeTokens | None = Field(None, exclude_if=_absent_if_none)


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, exclude_if=_absent_if_none)
    arguments: str | None = Field(None, exclude_if=_absent_if_none)


class ToolCallDelta(BaseModel):
    """OpenAI's streamed tool call: the first delta of a call has id, type and name (arguments ""), the
    next ones only more of `function.arguments`; `index` says which call a delta belongs to."""

    index: int
    id: str | None = Field(None, exclude_if=_absent_if_none)
    type: Literal["function"] | None = Field(None, exclude_if=_absent_if_none)
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_absent_if_none)
    content: str | None = Field(None, exclude_if=_absent_if_none)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_absent_if_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative: SpeculativeStats | SpeculativeTokens | None = Field(None, exclude_if=_absent_if_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "csd-serve"
    max_model_len: int = Field(
        description="the model's context in tokens, prompt and output together (vLLM's)"
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OCMPattern(BaseModel):
    draft_token: int
    target_token: int
    draft_text: str
    target_text: str
    count: int


class OCMNamespaceTop(BaseModel):
    namespace: str
    drafter: str
    patterns: list[OCMPattern]


class OCMTop(BaseModel):
    object: Literal["list"] = "list"
    data: list[OCMNamespaceTop]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
