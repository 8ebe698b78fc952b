"""POST /v1/responses: OpenAI's Responses API (JSON, or its typed Server-Sent Events with `stream: true`).

Planning, tools and structured output are the chat endpoint's (`service/api/responses_api.py` turns the
request into a chat request); the engine work goes through the same queue, cancellation and deadline as
chat completions (`service/api/streaming.py`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from service.api.deps import Authorized, ServingRuntime, ServingWorker, State
from service.api.errors import SERVER, APIError
from service.api.events import DoneEvent, ErrorEvent, Event, GenerationPlan, Job, StepEvent
from service.api.formatters import ChoiceResult, speculative_stats
from service.api.openapi import error_responses
from service.api.plan import plan_chat
from service.api.responses_api import (
    ChatForm,
    InputTokensDetails,
    ResponseBuilder,
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    ResponseUsage,
    StoredResponse,
    chat_form,
    renamed,
)
from service.api.streaming import (
    SSE_HEADERS,
    admit,
    cancel_on_disconnect,
    collect,
    next_event,
    refuse_if_full,
)
from service.api.tools import tool_plan
from service.api.worker import EngineWorker
from service.decoding import GenerationStats

router = APIRouter(prefix="/v1", tags=["generation"], dependencies=[Authorized])
log = logging.getLogger(__name__)

_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@router.post(
    "/responses",
    response_model=None,
    responses={
        200: {
            "model": ResponseObject,
            "description": "the response; with `stream: true`, Server-Sent Events `event: <type>` / "
            "`data: {...}` (response.created ... response.completed)",
            "content": {"text/event-stream": {"schema": _EVENT}},
        },
        **error_responses(400, 401, 404, 429, 500, 503, 504),
    },
)
async def create_response(
    body: ResponsesRequest, request: Request, state: State, runtime: ServingRuntime, worker: ServingWorker
) -> Response:
    arrived = time.monotonic()
    refuse_if_full(worker, 1)
    store = _store(request)
    history = store.conversation(body.previous_response_id) if body.previous_response_id else []
    form = chat_form(body, history)
    try:
        tools = tool_plan(form.chat, state.settings.tool_call_parser)
        plan = await plan_chat(form.chat, state.settings, runtime, tools)
    except APIError as error:
        raise renamed(error, form.origins) from None
    builder = ResponseBuilder(body, runtime.model_id, tools)
    job = admit(state, worker, plan, arrived)
    try:
        async with cancel_on_disconnect(request, worker, [job]):
            if not body.stream:
                result = (await collect(worker, job)).choices[0]
                builder.feed(result.text)
                _finish(builder, plan, result, result.finish_reason, result.stats)
                _keep(store, body, builder, form)
                return JSONResponse(builder.response())
            first = await next_event(worker, job)
            if isinstance(first, ErrorEvent):
                raise first.error
    except BaseException:
        worker.cancel(job, "request failed")
        raise
    stream = _events(worker, job, builder, first, lambda: _keep(store, body, builder, form))
    return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)


def _finish(
    builder: ResponseBuilder,
    plan: GenerationPlan,
    result: ChoiceResult,
    finish_reason: str,
    stats: GenerationStats | None,
) -> list[dict]:
    stats = stats or GenerationStats(prompt_tokens=len(plan.prompt_ids))
    usage = ResponseUsage(
        input_tokens=stats.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=stats.cached_tokens),
        output_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
    )
    provenance = result.provenance if plan.return_provenance else None
    return builder.finish(finish_reason, usage, speculative_stats(plan, stats, provenance))


def _keep(store: ResponseStore, body: ResponsesRequest, builder: ResponseBuilder, form: ChatForm) -> None:
    if body.store:
        store.put(builder.id, StoredResponse(builder.conversation(form.conversation)))


def _sse(event: dict) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _events(
    worker: EngineWorker, job: Job, builder: ResponseBuilder, first: Event, keep
) -> AsyncIterator[bytes]:
    finished = False
    result = ChoiceResult(index=0)
    try:
        for event in builder.start():
            yield _sse(event)
        event = first
        while True:
            if isinstance(event, StepEvent):
                result.add_step(event)
                for out in builder.feed(event.text):
                    yield _sse(out)
            elif isinstance(event, DoneEvent):
                result.finish(event)
                tail = _finish(builder, job.plan, result, event.finish_reason, event.stats)
                keep()
                for out in tail:
                    yield _sse(out)
                finished = True
                return
            elif isinstance(event, ErrorEvent):
                raise event.error
            event = await next_event(worker, job)
    except APIError as error:
        finished = True
        worker.cancel(job, "failed")
        yield _sse(_error_event(builder, error))
    except Exception:
        log.exception("a responses stream failed after it began")
        finished = True
        worker.cancel(job, "failed")
        failure = APIError(
            500,
            "the stream failed on the server (details in the server log)",
            type=SERVER,
            code="internal_error",
        )
        yield _sse(_error_event(builder, failure))
    finally:
        if not finished:
            worker.cancel(job, "client disconnected")


def _error_event(builder: ResponseBuilder, error: APIError) -> dict:
    """OpenAI's `error` event: the stream ends with it."""
    return builder._event("error", code=error.code, message=error.message, param=error.param)
