"""OpenAI's Responses API: `POST /v1/responses` (JSON, or its typed Server-Sent Events with `stream: true`,
or with `background: true` an answer at once and the generation after), and the stored responses' routes
`GET` / `DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.

Planning, tools and structured output are the chat endpoint's (`service/api/responses_api.py` turns the
request into a chat request); the engine work goes through the same queue, cancellation and deadline as
chat completions (`service/api/streaming.py`). A background response is one more job on the same engine,
driven by a task on the event loop that updates its stored record; the client's connection no longer
matters to it, only its deadline and a cancel do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from service.api.deps import Authorized, ServingRuntime, ServingWorker, State
from service.api.errors import NOT_CANCELLABLE, SERVER, APIError, bad_request, unsupported
from service.api.events import DoneEvent, ErrorEvent, Event, GenerationPlan, Job, StepEvent
from service.api.formatters import ChoiceResult, speculative_stats
from service.api.openapi import error_responses
from service.api.plan import plan_chat
from service.api.response_store import ResponseStore, StoredResponse
from service.api.responses_api import ChatForm, ResponsesRequest, chat_form, refusal, renamed
from service.api.responses_output import (
    InputTokensDetails,
    ResponseBuilder,
    ResponseObject,
    ResponseUsage,
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
            "`data: {...}` (response.created ... response.completed); with `background: true`, the "
            "response `queued`, to poll with GET /v1/responses/{id}",
            "content": {"text/event-stream": {"schema": _EVENT}},
        },
        **error_responses(400, 401, 404, 429, 500, 503, 504),
    },
)
async def create_response(
    body: ResponsesRequest, request: Request, state: State, runtime: ServingRuntime, worker: ServingWorker
) -> Response:
    arrived = time.monotonic()
    store = _store(request)
    refused = refusal(body, store)
    if refused is not None:
        raise refused
    refuse_if_full(worker, 1)
    history = store.conversation(body.previous_response_id) if body.previous_response_id else []
    form = chat_form(body, history)
    try:
        tools = tool_plan(form.chat, state.settings.tool_call_parser)
        plan = await plan_chat(form.chat, state.settings, runtime, tools)
    except APIError as error:
        if error.code == "context_length_exceeded" and body.truncation == "auto":
            error.message += "; truncation 'auto' drops nothing on this server: send fewer input items"
        raise renamed(error, form.origins) from None
    builder = ResponseBuilder(body, runtime.model_id, tools)
    job = admit(state, worker, plan, arrived)
    if body.background:
        return JSONResponse(_start_in_background(store, worker, job, builder, form).response)
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


@router.get(
    "/responses/{response_id}",
    response_model=ResponseObject,
    responses=error_responses(400, 401, 404),
)
async def retrieve_response(response_id: str, request: Request, stream: bool = False) -> Response:
    """A stored response as it stands: a background one's status moves from queued to where it ends."""
    if stream:
        raise unsupported("stream", "stream: true on GET /v1/responses/{id} (poll it without stream)")
    return JSONResponse(_store(request).get(response_id).response)


@router.delete(
    "/responses/{response_id}",
    responses=error_responses(401, 404),
)
async def delete_response(response_id: str, request: Request) -> Response:
    """Forget a stored response (a background one that is running is cancelled first)."""
    stored = _store(request).delete(response_id)
    if stored.background and not stored.finished:
        _cancel(stored)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post(
    "/responses/{response_id}/cancel",
    response_model=ResponseObject,
    responses=error_responses(400, 401, 404),
)
async def cancel_response(response_id: str, request: Request) -> Response:
    """Stop a background response's generation: it ends `cancelled`, with what it had written so far. A
    finished one is returned as it is (cancelling twice, or too late, is no error)."""
    stored = _store(request).get(response_id)
    if not stored.background:
        raise bad_request(
            f"the response {response_id!r} was not created with background: true; only background "
            "responses can be cancelled",
            param="response_id",
            code=NOT_CANCELLABLE,
        )
    if not stored.finished:
        _cancel(stored)
    return JSONResponse(stored.response)


# ---------------------------------------------------------------- background responses


def _start_in_background(
    store: ResponseStore, worker: EngineWorker, job: Job, builder: ResponseBuilder, form: ChatForm
) -> StoredResponse:
    """Store the response queued and run its generation in a task of the event loop."""
    stored = StoredResponse(builder.response(), background=True)

    def cancel() -> None:
        builder.stop("cancelled")
        stored.response = builder.response()
        worker.cancel(job, "cancelled")

    stored.cancel = cancel
    store.put(builder.id, stored)
    stored.task = asyncio.get_running_loop().create_task(_generate(worker, job, builder, form, stored))
    return stored


def _cancel(stored: StoredResponse) -> None:
    assert stored.cancel is not None and stored.task is not None
    stored.cancel()
    stored.task.cancel()  # it may be waiting for the engine's answer to the abort: nothing is left to read


async def _generate(
    worker: EngineWorker, job: Job, builder: ResponseBuilder, form: ChatForm, stored: StoredResponse
) -> None:
    """Run a background response to its end, keeping its stored record up to date. Every way out leaves
    the record in a final status: completed or incomplete, failed (timeout, engine failure, shutdown) or
    cancelled (by POST .../cancel, DELETE, or the server stopping its tasks)."""
    result = ChoiceResult(index=0)
    try:
        while True:
            event = await next_event(worker, job)
            if isinstance(event, ErrorEvent):
                raise event.error
            if builder.status == "queued":  # its first round ran
                builder.status = "in_progress"
                stored.response = builder.response()
            if isinstance(event, StepEvent):
                result.add_step(event)
                builder.feed(event.text)
            elif isinstance(event, DoneEvent):
                result.finish(event)
                _finish(builder, job.plan, result, event.finish_reason, event.stats)
                stored.conversation = builder.conversation(form.conversation)
                return
    except APIError as error:
        worker.cancel(job, "failed")
        builder.stop("failed", error)
    except asyncio.CancelledError:
        worker.cancel(job, "cancelled")
        if builder.status in ("queued", "in_progress"):  # not cancelled by a client: the server stopped
            builder.stop("cancelled")
        raise
    except Exception:
        log.exception("a background response failed")
        worker.cancel(job, "failed")
        builder.stop("failed", _internal_error())
    finally:
        stored.response = builder.response()
        stored.cancel = None


def _internal_error() -> APIError:
    return APIError(
        500,
        "the generation failed on the server (details in the server log)",
        type=SERVER,
        code="internal_error",
    )


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
        store.put(builder.id, StoredResponse(builder.response(), builder.conversation(form.conversation)))


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
        yield _sse(builder.error_event(error))
    except Exception:
        log.exception("a responses stream failed after it began")
        finished = True
        worker.cancel(job, "failed")
        yield _sse(builder.error_event(_internal_error()))
    finally:
        if not finished:
            worker.cancel(job, "client disconnected")
