"""POST /v1/completions and POST /v1/chat/completions (JSON, or SSE with `stream: true`): each plans its
request, names its formatter (`formatters.py`) and hands both to the one driver (`driver.py`)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api.deps import Authorized, ServingRuntime, ServingWorker, State
from service.api.driver import RequestRun, refuse_if_full, respond
from service.api.formatters import ChatFormatter, CompletionFormatter
from service.api.openapi import error_responses
from service.api.plan import plan_chat, plan_completion
from service.api.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
)
from service.api.tools import tool_plan

router = APIRouter(prefix="/v1", tags=["generation"], dependencies=[Authorized])

_ERRORS = error_responses(400, 401, 404, 429, 500, 503, 504)


_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}


def _responses(body_model: type, chunk_model: type) -> dict[int | str, dict]:
    return {
        200: {
            "model": body_model,
            "description": f"the completion; with `stream: true`, Server-Sent Events: `data: {{{chunk_model.__name__}}}`"
            " events, then `data: [DONE]`",
            # OpenAPI 3.1: the schema of an event stream describes one event (its `data` line: a JSON chunk,
            # an error object, or [DONE])
            "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        },
        **_ERRORS,
    }


@router.post(
    "/completions",
    response_model=None,
    responses=_responses(CompletionResponse, CompletionChunk),
)
async def create_completion(
    body: CompletionRequest, request: Request, state: State, runtime: ServingRuntime, worker: ServingWorker
) -> Response:
    arrived = time.monotonic()
    refuse_if_full(worker, body.n or 1)
    plans = await plan_completion(body, state.settings, runtime)
    formatter = CompletionFormatter(
        runtime.model_id, plans[0], include_usage=body.include_usage, continuous_usage=body.continuous_usage
    )
    run = RequestRun.admit(state, worker, plans, arrived)
    return await respond(request, run, formatter, stream=body.stream)


@router.post(
    "/chat/completions",
    response_model=None,
    responses=_responses(ChatCompletionResponse, ChatCompletionChunk),
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    state: State,
    runtime: ServingRuntime,
    worker: ServingWorker,
) -> Response:
    arrived = time.monotonic()
    refuse_if_full(worker, body.n or 1)
    tools = tool_plan(body, state.settings.tool_call_parser)
    plan = await plan_chat(body, state.settings, runtime, tools)
    formatter = ChatFormatter(
        runtime.model_id,
        plan,
        include_usage=body.include_usage,
        tools=tools,
        continuous_usage=body.continuous_usage,
    )
    run = RequestRun.admit(state, worker, [plan], arrived)
    return await respond(request, run, formatter, stream=body.stream)
