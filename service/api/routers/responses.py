"""OpenAI's Responses API: `POST /v1/responses` (JSON, or its typed Server-Sent Events with `stream: true`,
or with `background: true` an answer at once and the generation after), and the stored responses' routes
`GET` / `DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.

Planning, tools and structured output are the chat endpoint's (`service/api/responses_api.py` turns the
request into a chat request); the generation runs through the one driver every API uses
(`service/api/driver.py`: admission, deadline, cancellation, usage, errors), with the Responses API's
formatter (`ResponsesFormatter`). A background response is the same generation run to its end by a task on
the event loop, with its chunks dropped, that updates its stored record; the client's connection no longer
matters to it, only its deadline and a cancel do.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from service.api.deps import Authorized, ServingRuntime, ServingWorker, State
from service.api.driver import RequestRun, refuse_if_full, respond, run_to_end
from service.api.errors import NOT_CANCELLABLE, APIError, bad_request, unsupported
from service.api.openapi import error_responses
from service.api.plan import plan_chat
from service.api.response_store import ResponseStore, StoredResponse
from service.api.responses_api import ChatForm, ResponsesRequest, chat_form, refusal, renamed
from service.api.responses_output import ResponseBuilder, ResponseObject, ResponsesFormatter
from service.api.tools import tool_plan

router = APIRouter(prefix="/v1", tags=["generation"], dependencies=[Authorized])

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
    if body.background:
        run = RequestRun.admit(state, worker, [plan], arrived, abandoned="cancelled")
        return JSONResponse(_start_in_background(store, run, builder, form).response)

    def keep() -> None:
        if body.store:
            store.put(builder.id, StoredResponse(builder.response(), builder.conversation(form.conversation)))

    run = RequestRun.admit(state, worker, [plan], arrived)
    return await respond(request, run, ResponsesFormatter(builder, plan, keep), stream=body.stream)


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
    store: ResponseStore, run: RequestRun, builder: ResponseBuilder, form: ChatForm
) -> StoredResponse:
    """Store the response queued and run it (its `RequestRun`) in a task of the event loop."""
    stored = StoredResponse(builder.response(), background=True)

    def cancel() -> None:
        builder.stop("cancelled")
        stored.response = builder.response()
        run.cancel("cancelled")

    def keep() -> None:
        stored.conversation = builder.conversation(form.conversation)

    stored.cancel = cancel
    store.put(builder.id, stored)
    formatter = ResponsesFormatter(builder, run.plans[0], keep)
    stored.task = asyncio.get_running_loop().create_task(_generate(run, formatter, stored))
    return stored


def _cancel(stored: StoredResponse) -> None:
    assert stored.cancel is not None and stored.task is not None
    stored.cancel()
    stored.task.cancel()  # it may be waiting for the engine's answer to the abort: nothing is left to read


async def _generate(run: RequestRun, formatter: ResponsesFormatter, stored: StoredResponse) -> None:
    """Run a background response to its end through the driver, keeping its stored record up to date. Every
    way out leaves the record in a final status: completed or incomplete, failed (timeout, engine failure,
    shutdown: the formatter's error) or cancelled (by POST .../cancel, DELETE, or the server stopping its
    tasks)."""
    builder = formatter.builder

    def started() -> None:  # its first round ran
        builder.status = "in_progress"
        stored.response = builder.response()

    try:
        await run_to_end(run, formatter, started)
    except asyncio.CancelledError:
        run.cancel("cancelled")
        if builder.running:  # not cancelled by a client: the server stopped
            builder.stop("cancelled")
        raise
    finally:
        stored.response = builder.response()
        stored.cancel = None
