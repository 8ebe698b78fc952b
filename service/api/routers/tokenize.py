"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info and GET /version.

The shapes are vLLM's (`vllm/entrypoints/openai/protocol.py`), so tools written for a vLLM server (prompt
budgeting, token counting in LangChain's and LlamaIndex's vLLM integrations) work here unchanged:
- /tokenize takes either `prompt` (text) or `messages` (rendered by the chat template exactly as
  /v1/chat/completions renders them, `tools` included) and answers {count, max_model_len, tokens,
  token_strs?};
- /detokenize takes `tokens` and answers {prompt};
- /tokenizer_info answers the tokenizer's special tokens, chat template and length: with /tokenize and
  /detokenize, what lm-eval's "remote" tokenizer needs, so an evaluation harness needs no local copy.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from service import __version__
from service.api.deps import Authorized, ServingRuntime
from service.api.errors import INCONSISTENT, INVALID_TOKEN_ID, bad_request
from service.api.openapi import error_responses
from service.api.plan import check_model, check_text, encode_messages
from service.api.schemas import ChatMessage, TokenId, Tool, _Request
from service.runtime import Runtime

router = APIRouter(tags=["tokenizer"])
_ERRORS = error_responses(400, 401, 404, 503)


def _one_of_prompt_and_messages(schema: dict[str, Any]) -> None:
    # vLLM documents two request types; one body with this rule says the same.
    chat_only = ("messages", "tools", "add_generation_prompt", "continue_final_message")
    schema["oneOf"] = [
        {
            "required": ["prompt"],
            "properties": {"prompt": {"type": "string"}, **dict.fromkeys(chat_only, False)},
        },
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": False}},
    ]


class TokenizeRequest(_Request):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one body: `prompt` or `messages`."""

    # merged with the base class's config (strict, extra="ignore", ...)
    model_config = ConfigDict(json_schema_extra=_one_of_prompt_and_messages)

    model: str | None = Field(None, description="the served model id (default: the one served)")
    prompt: str | None = Field(None, description="text to tokenize (or send `messages`)")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="a conversation, rendered by the chat template"
    )
    tools: list[Tool] | None = Field(None, description="with `messages`: tool definitions, as in chat")
    add_special_tokens: bool | None = Field(
        None,
        description="add the tokenizer's special tokens (BOS, ...); default: true for `prompt`, false for "
        "`messages` (the chat template adds its own)",
    )
    add_generation_prompt: bool = Field(True, description="with `messages`: end with the assistant header")
    continue_final_message: bool = Field(
        False, description="with `messages`: leave the last message open, for the model to continue"
    )
    return_token_strs: bool = Field(False, description="also return each token's string")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages, not with prompt")
        return self

    def generation_prompt(self) -> bool:
        """add_generation_prompt as rendered. As vLLM: continue_final_message turns the default off, and
        only an explicit add_generation_prompt: true contradicts it (a rule across fields: a 400 of its own)."""
        if not self.continue_final_message:
            return self.add_generation_prompt
        if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message needs add_generation_prompt: false",
                param="continue_final_message",
                code=INCONSISTENT,
            )
        return False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(None, exclude_if=lambda value: value is None)


class DetokenizeRequest(_Request):
    model: str | None = Field(None, description="the served model id (default: the one served)")
    tokens: list[TokenId] = Field(description="token ids to turn back into text")


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def _check_model(name: str | None, runtime: Runtime) -> None:
    if name is not None:
        check_model(name, runtime)


def _special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """What the tokenizer adds around a text (BOS, EOS, ...), found by tokenizing one word both ways
    (transformers 5's tokenizers no longer offer build_inputs_with_special_tokens)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    marked = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(marked) - len(plain) + 1):
        if marked[start : start + len(plain)] == plain:
            return marked[:start], marked[start + len(plain) :]
    return [], []


def _tokenize_prompt(runtime: Runtime, prompt: str, add_special_tokens: bool) -> list[int]:
    return list(runtime.target.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS, dependencies=[Authorized])
async def tokenize(body: TokenizeRequest, runtime: ServingRuntime) -> TokenizeResponse:
    _check_model(body.model, runtime)
    tokenizer = runtime.target.tokenizer
    if body.prompt is not None:
        check_text(body.prompt, "prompt")
        ids = await run_in_threadpool(
            _tokenize_prompt, runtime, body.prompt, body.add_special_tokens is not False
        )
    else:
        assert body.messages is not None
        ids = await encode_messages(
            runtime,
            body.messages,
            body.tools,
            add_generation_prompt=body.generation_prompt(),
            continue_final_message=body.continue_final_message,
        )
        if body.add_special_tokens:
            prefix, suffix = _special_tokens(tokenizer)
            ids = [*prefix, *ids, *suffix]
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=runtime.target.max_context, tokens=ids, token_strs=strs
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS, dependencies=[Authorized])
async def detokenize(body: DetokenizeRequest, runtime: ServingRuntime) -> DetokenizeResponse:
    _check_model(body.model, runtime)
    tokenizer = runtime.target.tokenizer
    vocab = len(tokenizer)  # added tokens included: ids past vocab_size can still be valid
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise bad_request(
                f"tokens.{i} is {token}, outside this model's vocabulary (0 to {vocab - 1})",
                param=f"tokens.{i}",
                code=INVALID_TOKEN_ID,
            )
    text = await run_in_threadpool(tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


class TokenizerInfoResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int = Field(description="the served context length")
    vocab_size: int


@router.get(
    "/tokenizer_info", response_model=TokenizerInfoResponse, responses=_ERRORS, dependencies=[Authorized]
)
async def tokenizer_info(runtime: ServingRuntime) -> TokenizerInfoResponse:
    tokenizer = runtime.target.tokenizer
    template = tokenizer.chat_template
    return TokenizerInfoResponse(
        tokenizer_class=type(tokenizer).__name__,
        eos_token=tokenizer.eos_token,
        bos_token=tokenizer.bos_token,
        pad_token=tokenizer.pad_token,
        unk_token=tokenizer.unk_token,
        chat_template=template if isinstance(template, str) else None,
        model_max_length=runtime.target.max_context,
        vocab_size=runtime.target.vocab_size,
    )
