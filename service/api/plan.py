"""From a validated request body to a `GenerationPlan`: the checks that need the server's settings or the
model (model name, token cap, drafter availability, prompt length against the context), so that every
user error is a 400/404 before anything waits in the queue."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from service.api.errors import (
    INCONSISTENT,
    INVALID_GRAMMAR,
    INVALID_TOKEN_ID,
    TOO_MANY_CHOICES,
    APIError,
    bad_request,
    unsupported,
)
from service.api.events import GenerationPlan
from service.api.schemas import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SpeculativeOptions,
    Tool,
)
from service.api.tenants import draft_pool
from service.api.tools import ToolPlan, render_messages, template_renders_tools
from service.config import Settings
from service.decoding import (
    Constraint,
    ConstraintKind,
    DecodingError,
    Method,
    SamplingParams,
    SpeculativeConfig,
)
from service.decoding.drafter_registry import drafter_entry
from service.decoding.grammar import model_grammar
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
            draft_pool=draft_pool(settings.draft_pool_scope),
        )
    except DecodingError as exc:
        raise bad_request(str(exc), param="speculative") from None
    if spec.speculates and drafter not in runtime.engine.drafters:
        available = ", ".join(sorted(runtime.engine.drafters))
        hint = drafter_entry(drafter).hint
        hint = f" ({hint})" if hint else ""
        raise bad_request(
            f"drafter {drafter!r} is not available on this server (available: {available}){hint}",
            param="speculative.drafter",
            code="unsupported_parameter",  # a setting of this server, not a bad value
        )
    return spec, drafter


def check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{param} is not valid Unicode (it holds a lone surrogate)", param=param, code="invalid_unicode"
        ) from None


def _completion_prompts(body: CompletionRequest, vocab_size: int) -> list[str | list[int]]:
    """The request's prompts: text, or token ids (checked against the vocabulary)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]  # one prompt of token ids
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}", param="prompt")
    if len(prompts) > 1 and body.stream:
        raise unsupported("prompt", "a batch of prompts with stream: true (send one prompt per stream)")
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if not p:
            raise bad_request("prompt must not be empty", param=param)
        if isinstance(p, str):
            check_text(p, param)
        elif any(not 0 <= t < vocab_size for t in p):
            raise bad_request(
                f"token ids must be in [0, {vocab_size}) for this model", param=param, code=INVALID_TOKEN_ID
            )
    return prompts


def _encode_chat(
    runtime: Runtime,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    try:
        return encode_chat(
            runtime.target.tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except DecodingError:
        raise
    except Exception as exc:  # a chat template may refuse a conversation (jinja raises its own errors)
        raise DecodingError(f"the model's chat template refused these messages: {exc}") from exc


async def encode_messages(
    runtime: Runtime,
    messages: list[ChatMessage],
    tools: Sequence[Tool] | None = None,
    *,
    parallel_tool_calls: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """A conversation's prompt ids, exactly as a chat completion renders it (also for /tokenize). `tools`:
    the definitions the model is shown (through the template if it renders them, else `tools`' default)."""
    for i, message in enumerate(messages):
        check_text(message.text, f"messages.{i}.content")
    native = template_renders_tools(runtime.target.tokenizer)
    rendered, template_tools = render_messages(messages, tools, native=native, parallel=parallel_tool_calls)
    try:
        # Rendering and tokenising a long conversation takes a while: off the event loop.
        return await run_in_threadpool(
            _encode_chat, runtime, rendered, template_tools, add_generation_prompt, continue_final_message
        )
    except DecodingError as exc:
        raise bad_request(str(exc), param="messages") from None


def _sampling(
    body: CompletionRequest | ChatCompletionRequest,
    settings: Settings,
    max_tokens: int,
    constraint: Constraint | None,
) -> SamplingParams:
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:  # 0 alternatives asks for nothing: fine without logprobs
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs", code=INCONSISTENT)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature if body.temperature is not None else settings.default_temperature,
            top_p=body.top_p if body.top_p is not None else 1.0,
            seed=body.seed,
            stop=body.stop_list,
            ignore_eos=bool(body.ignore_eos),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            min_tokens=body.min_tokens or 0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
            logit_bias=tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items()),
            logprobs=logprobs,
            constraint=constraint,
        )
    except DecodingError as exc:
        message = str(exc)
        # the ranges are the schema's: what is left spans fields (min_tokens above max_tokens, ...)
        raise bad_request(message, param=message.split(" ", 1)[0], code=INCONSISTENT) from None


def _check_token_ids(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    for param, ids in (
        ("logit_bias", [int(k) for k in body.logit_bias or {}]),
        ("stop_token_ids", body.stop_token_ids or []),
    ):
        if any(not 0 <= t < vocab_size for t in ids):
            raise bad_request(
                f"token ids must be in [0, {vocab_size}) for this model", param=param, code=INVALID_TOKEN_ID
            )


def requested_constraint(body: CompletionRequest | ChatCompletionRequest) -> tuple[Constraint, str] | None:
    """The structured output a request asks for (OpenAI's response_format or vLLM's structured_outputs),
    with the field to name in errors."""
    so = body.structured_outputs
    if so is not None:
        given = {
            name: value
            for name, value in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object or None),
            )
            if value is not None
        }
        if len(given) != 1:
            raise bad_request(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                param="structured_outputs",
                code=INCONSISTENT,
            )
        ((name, value),) = given.items()
        if name == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise bad_request(
                    f"structured_outputs.json is not valid JSON: {exc}",
                    param="structured_outputs.json",
                    code=INVALID_GRAMMAR,
                ) from None
        kind = {
            "json": ConstraintKind.JSON_SCHEMA,
            "regex": ConstraintKind.REGEX,
            "choice": ConstraintKind.CHOICE,
            "grammar": ConstraintKind.GRAMMAR,
            "json_object": ConstraintKind.JSON_OBJECT,
        }[name]
        return Constraint(kind, tuple(value) if name == "choice" else value), f"structured_outputs.{name}"
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT), "response_format"
    if rf.json_schema is None:
        raise bad_request(
            "response_format of type json_schema needs a json_schema",
            param="response_format",
            code=INCONSISTENT,
        )
    if rf.json_schema.schema_ is None:  # a name without a schema: any JSON object
        return Constraint(ConstraintKind.JSON_OBJECT), "response_format"
    return Constraint(
        ConstraintKind.JSON_SCHEMA, rf.json_schema.schema_
    ), "response_format.json_schema.schema"


async def _constraint(body: CompletionRequest | ChatCompletionRequest, runtime: Runtime) -> Constraint | None:
    requested = requested_constraint(body)
    if requested is None:
        return None
    constraint, param = requested
    return await checked(constraint, runtime, param)


async def checked(constraint: Constraint, runtime: Runtime, param: str, what: str = "") -> Constraint:
    """The constraint, once the grammar engine compiled it (a 400 naming `param` if it cannot)."""
    try:  # compiling a large schema takes a while: off the event loop
        await run_in_threadpool(model_grammar(runtime.target).check, constraint)
    except DecodingError as exc:
        raise bad_request(f"{what}{exc}", param=param, code=INVALID_GRAMMAR) from None
    return constraint


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


async def plan_completion(
    body: CompletionRequest, settings: Settings, runtime: Runtime
) -> list[GenerationPlan]:
    """One plan per prompt of the request."""
    check_request(body, settings, runtime)
    tokenizer = runtime.target.tokenizer
    prompts = _completion_prompts(body, runtime.target.vocab_size)
    if body.max_tokens == 0 and not body.echo:
        raise bad_request(
            "max_tokens 0 generates nothing; it only makes sense with echo",
            param="max_tokens",
            code=INCONSISTENT,
        )
    spec, drafter = speculative_config(settings, body.speculative, runtime)
    constraint = await _constraint(body, runtime)
    plans = []
    for prompt in prompts:
        # Tokenising a long prompt takes a while: off the event loop.
        if isinstance(prompt, str):
            ids = await run_in_threadpool(encode_prompt, tokenizer, prompt)
            text = prompt
        else:
            ids = list(prompt)
            text = await run_in_threadpool(tokenizer.decode, ids) if body.echo else ""
        plan = _plan(body, ids, spec, drafter, settings, runtime, constraint)
        echo = dict(echo_text=text, prompt_logprobs=body.logprobs) if body.echo else {}
        plans.append(dataclasses.replace(plan, generate=body.max_tokens != 0, **echo))
    return plans


async def plan_chat(
    body: ChatCompletionRequest, settings: Settings, runtime: Runtime, tools: ToolPlan | None = None
) -> GenerationPlan:
    """`tools`: what `tools.tool_plan(body)` made of the request's tool fields (None: plain text)."""
    check_request(body, settings, runtime)
    spec, drafter = speculative_config(settings, body.speculative, runtime)
    constraint = await _constraint(body, runtime)
    ids = await encode_messages(
        runtime,
        body.messages,
        tools.tools if tools else None,
        parallel_tool_calls=tools.parallel if tools else True,
    )
    schema = tools.constraint() if tools else None
    if schema is not None:  # tool_choice required or a named function: decoding enforces the JSON
        constraint = Constraint(ConstraintKind.JSON_SCHEMA, schema)
        constraint = await checked(constraint, runtime, "tools", "a tool's parameters cannot be enforced: ")
    return _plan(body, ids, spec, drafter, settings, runtime, constraint)


def _plan(
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    spec: SpeculativeConfig,
    drafter: str,
    settings: Settings,
    runtime: Runtime,
    constraint: Constraint | None = None,
) -> GenerationPlan:
    if not ids:
        raise bad_request("the prompt encodes to no tokens", param="prompt")
    n = body.n or 1
    # the runtime's settings: a model that cannot be batched runs one sequence at a time whatever was asked
    batch = runtime.settings.max_batch_size
    if n > batch:
        raise bad_request(
            f"n is {n}; this server runs at most {batch} sequences at once",
            param="n",
            code=TOO_MANY_CHOICES,
        )
    _check_token_ids(body, runtime.target.vocab_size)
    context = runtime.target.max_context
    if (
        body.requested_max_tokens == 0
    ):  # echo only: the prompt is scored, nothing generated (it may fill the context)
        if len(ids) > context:
            _max_tokens(None, body.max_tokens_param, len(ids), settings, context)  # its context_length error
        max_tokens = 1  # SamplingParams' floor; the plan generates nothing
    else:
        max_tokens = _max_tokens(
            body.requested_max_tokens, body.max_tokens_param, len(ids), settings, context
        )
    return GenerationPlan(
        prompt_ids=ids,
        sampling=_sampling(body, settings, max_tokens, constraint),
        spec=spec,
        drafter=drafter,
        return_provenance=bool(body.speculative and body.speculative.return_provenance),
        n=n,
    )
