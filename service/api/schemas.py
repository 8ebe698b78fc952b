"""Request and response bodies, with OpenAI's field names and shapes.

Requests are validated strictly (a string is not a number, a number is not a string): a wrong type is a 400
naming the field. Unknown top-level fields are ignored, as vLLM does, so newer clients keep working; fields
we know but do not support (n > 1, logprobs, tools, ...) are refused by `unsupported_field()` with a 400
that names them. The `speculative` extension object is ours, so it refuses unknown keys (typos).
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FinishReason = Literal["stop", "length"]
MethodName = Literal["vanilla", "sd", "lossy", "csd"]
ProvenanceName = Literal["accepted", "rescued", "recovered", "bonus", "plain"]

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_STOP_SEQUENCES = 16


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
            k: int(v) if k in fields and isinstance(v, float) and v.is_integer() else v
            for k, v in data.items()
        }


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="add a last chunk with `usage` (and `speculative`)")


class SpeculativeOptions(_Request):
    """Per-request overrides of the server's speculation defaults (a csd-serve extension)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    method: MethodName | None = Field(None, description="vanilla | sd (lossless) | lossy | csd")
    drafter: Literal["ngram", "head", "combined", "model"] | None = Field(
        None,
        description="ngram (prompt lookup), head (the trained draft head), combined (prompt lookup where it "
        "matches, else the head) or model (a draft model)",
    )
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


class _GenerationRequest(_Request):
    model: str = Field(description="the served model id (see GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy (the server default)")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = Field(
        None, json_schema_extra=_non_empty_strings
    )
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    # Known OpenAI fields we do not support: accepted at their neutral values, refused otherwise.
    n: int | None = Field(None, ge=1, description="only 1 is supported")
    presence_penalty: float | None = Field(None, description="not supported (only 0)")
    frequency_penalty: float | None = Field(None, description="not supported (only 0)")
    logit_bias: dict[str, Any] | None = Field(None, description="not supported")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_limit(cls, value: object) -> object:
        # Checked before the str | list union, whose first member would report "a valid string" instead.
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(value)}")
        return value

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, what) for the first field set to something we cannot honour, or None."""
        if self.n not in (None, 1):
            return "n", "n > 1 (several choices per request)"
        if self.presence_penalty not in (None, 0):
            return "presence_penalty", "presence_penalty"
        if self.frequency_penalty not in (None, 0):
            return "frequency_penalty", "frequency_penalty"
        if self.logit_bias:
            return "logit_bias", "logit_bias"
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
    def requested_max_tokens(self) -> int | None:
        """The token budget the request asks for (chat requests may name it max_completion_tokens)."""
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field an error about the budget names."""
        return "max_tokens"


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra=_non_empty_prompt,
        description="the prompt text (a list holding one string is accepted too)",
    )
    echo: bool | None = Field(None, description="not supported")
    logprobs: int | None = Field(None, description="not supported")
    best_of: int | None = Field(None, description="not supported (only 1)")
    suffix: str | None = Field(None, description="not supported")

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo"
        if self.logprobs is not None:
            return "logprobs", "logprobs"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1"
        if self.suffix is not None:
            return "suffix", "suffix"
        return super().unsupported_field()


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] = Field(
        description="text, or a list of text parts", json_schema_extra=_text_parts
    )
    name: str | None = None
    tool_calls: list[Any] | None = Field(None, description="not supported")

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got type {kind!r}")
                TextContentPart.model_validate(part)
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")
    logprobs: bool | None = Field(None, description="not supported")
    top_logprobs: int | None = Field(None, description="not supported")
    tools: list[Any] | None = Field(None, description="not supported")
    tool_choice: Any = Field(None, description="not supported (only 'none')")
    functions: list[Any] | None = Field(None, description="not supported")
    function_call: Any = Field(None, description="not supported")
    response_format: dict[str, Any] | None = Field(None, description="only {'type': 'text'}")
    modalities: list[str] | None = Field(None, description="only ['text']")
    audio: Any = Field(None, description="not supported")
    prediction: Any = Field(None, description="not supported")

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "logprobs"
        if self.top_logprobs is not None:
            return "top_logprobs", "top_logprobs"
        for name in ("tools", "functions", "function_call", "audio", "prediction"):
            if getattr(self, name):
                return name, f"{name} (tool and function calling, audio, predicted outputs)"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool_choice"
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            return "response_format", "a response_format other than text"
        if self.modalities is not None and set(self.modalities) - {"text"}:
            return "modalities", "output modalities other than text"
        for i, message in enumerate(self.messages):
            if message.tool_calls:
                return f"messages.{i}.tool_calls", "tool_calls"
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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
    tokens: list[ProvenanceToken] | None = Field(
        None, exclude_if=_absent_if_none, description="with return_provenance"
    )


class SpeculativeTokens(BaseModel):
    """The provenance of a stream chunk's tokens (with `speculative.return_provenance`)."""

    tokens: list[ProvenanceToken]
    draft_tokens: int = Field(0, description="draft tokens this round verified (for live acceptance rates)")


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
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


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_absent_if_none)
    content: str | None = Field(None, exclude_if=_absent_if_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
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
