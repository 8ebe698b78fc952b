"""From a validated request body to a `GenerationPlan`: the checks that need the server's settings or the
model (model name, token cap, drafter availability, prompt length against the context), so that every
user error is a 400/404 before anything waits in the queue."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from service.api.errors import APIError, bad_request, unsupported
from service.api.schemas import ChatCompletionRequest, CompletionRequest, SpeculativeOptions
from service.api.worker import GenerationPlan
from service.config import Settings
from service.decoding import DecodingError, Method, SamplingParams, SpeculativeConfig
from service.decoding.text import encode_chat, encode_prompt
from service.runtime import Runtime


def check_model(name: str, runtime: Runtime) -> None:
    if name not in served_names(runtime):
        raise APIError(
            404,
            f"the model {name!r} does not exist on this server; it serves {runtime.model_id!r}",
            param="model",
            code="model_not_found",
        )


def served_names(runtime: Runtime) -> set[str]:
    """The model id, plus the spec it was loaded from (e.g. "embedded") unless a served name replaces it."""
    names = {runtime.model_id}
    if not runtime.settings.served_model_name:
        names.add(runtime.settings.model)
    return names


def speculative_config(
    settings: Settings, options: SpeculativeOptions | None, runtime: Runtime
) -> tuple[SpeculativeConfig, str]:
    """The server's defaults with the request's overrides -> (config, drafter name)."""
    o = options or SpeculativeOptions()
    drafter = o.drafter or settings.drafter
    try:
        spec = SpeculativeConfig(
            method=Method(o.method) if o.method else settings.method,
            num_speculative_tokens=(
                o.num_speculative_tokens
                if o.num_speculative_tokens is not None
                else settings.num_speculative_tokens
            ),
            lambda_=o.lambda_ if o.lambda_ is not None else settings.lambda_,
            tau=o.tau if o.tau is not None else settings.tau,
            lossy_threshold=settings.lossy_threshold,
            guard_facts=o.guard_facts if o.guard_facts is not None else settings.guard_facts,
        )
    except DecodingError as exc:
        raise bad_request(str(exc), param="speculative") from None
    if spec.speculates and drafter not in runtime.engine.drafters:
        available = ", ".join(sorted(runtime.engine.drafters))
        hints = {
            "model": " (start the server with --draft-model to enable 'model')",
            "head": " (the server has no draft head for its model: --draft-head FOLDER)",
            "combined": " (the server has no draft head for its model: --draft-head FOLDER)",
        }
        hint = hints.get(drafter, "")
        raise bad_request(
            f"drafter {drafter!r} is not available on this server (available: {available}){hint}",
            param="speculative.drafter",
            code="unsupported_parameter",  # a setting of this server, not a bad value
        )
    return spec, drafter


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{param} is not valid Unicode (it holds a lone surrogate)", param=param, code="invalid_unicode"
        ) from None


def _completion_prompt(body: CompletionRequest) -> str:
    prompt = body.prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if not all(isinstance(p, str) for p in prompt):
            raise unsupported("prompt", "a prompt of token ids (send the text instead)")
        if len(prompt) > 1:
            raise unsupported("prompt", f"a batch of {len(prompt)} prompts (send one prompt per request)")
        prompt = prompt[0]
    assert isinstance(prompt, str)
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    _check_text(prompt, "prompt")
    return prompt


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    messages = []
    for i, message in enumerate(body.messages):
        text = message.text
        _check_text(text, f"messages.{i}.content")
        # Chat templates know "system"; OpenAI's newer "developer" role means the same thing.
        role = "system" if message.role == "developer" else message.role
        messages.append({"role": role, "content": text})
    return messages


def _encode_chat(runtime: Runtime, messages: list[dict[str, str]]) -> list[int]:
    try:
        return encode_chat(runtime.target.tokenizer, messages)
    except DecodingError:
        raise
    except Exception as exc:  # a chat template may refuse a conversation (jinja raises its own errors)
        raise DecodingError(f"the model's chat template refused these messages: {exc}") from exc


def _sampling(
    body: CompletionRequest | ChatCompletionRequest, settings: Settings, max_tokens: int
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature if body.temperature is not None else settings.default_temperature,
            top_p=body.top_p if body.top_p is not None else 1.0,
            seed=body.seed,
            stop=body.stop_list,
        )
    except DecodingError as exc:
        raise bad_request(str(exc)) from None


def _max_tokens(requested: int | None, param: str, prompt_len: int, settings: Settings, context: int) -> int:
    """The token budget: the request's (within the cap and the context), or the default clipped to fit."""
    if prompt_len >= context:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens; this model's context is {context} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return max(1, min(settings.default_max_tokens, context - prompt_len))
    if prompt_len + requested > context:
        raise APIError(
            400,
            f"this model's context is {context} tokens; the prompt takes {prompt_len} and "
            f"{param} asks for {requested} more",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def check_request(
    body: CompletionRequest | ChatCompletionRequest, settings: Settings, runtime: Runtime
) -> None:
    """Everything that needs no tokenizer: unsupported fields, the model name, the token cap."""
    refused = body.unsupported_field()
    if refused is not None:
        raise unsupported(*refused)
    check_model(body.model, runtime)
    if any(not s for s in body.stop_list):
        raise bad_request("stop strings must not be empty", param="stop")
    requested, param = body.requested_max_tokens, body.max_tokens_param
    if requested is not None and requested > settings.max_tokens_cap:
        raise APIError(
            400,
            f"{param} is {requested}, above this server's limit of {settings.max_tokens_cap}",
            param=param,
            code="max_tokens_exceeded",
        )


async def plan_completion(body: CompletionRequest, settings: Settings, runtime: Runtime) -> GenerationPlan:
    check_request(body, settings, runtime)
    prompt = _completion_prompt(body)
    spec, drafter = speculative_config(settings, body.speculative, runtime)
    # Tokenising a long prompt takes a while: off the event loop.
    ids = await run_in_threadpool(encode_prompt, runtime.target.tokenizer, prompt)
    return _plan(body, ids, spec, drafter, settings, runtime)


async def plan_chat(body: ChatCompletionRequest, settings: Settings, runtime: Runtime) -> GenerationPlan:
    check_request(body, settings, runtime)
    messages = _chat_messages(body)
    spec, drafter = speculative_config(settings, body.speculative, runtime)
    try:
        ids = await run_in_threadpool(_encode_chat, runtime, messages)
    except DecodingError as exc:
        raise bad_request(str(exc), param="messages") from None
    return _plan(body, ids, spec, drafter, settings, runtime)


def _plan(
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    spec: SpeculativeConfig,
    drafter: str,
    settings: Settings,
    runtime: Runtime,
) -> GenerationPlan:
    if not ids:
        raise bad_request("the prompt encodes to no tokens", param="prompt")
    max_tokens = _max_tokens(
        body.requested_max_tokens, body.max_tokens_param, len(ids), settings, runtime.target.max_context
    )
    return GenerationPlan(
        prompt_ids=ids,
        sampling=_sampling(body, settings, max_tokens),
        spec=spec,
        drafter=drafter,
        return_provenance=bool(body.speculative and body.speculative.return_provenance),
    )
