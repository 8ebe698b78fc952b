"""Run a plan through the engine worker and answer with JSON or Server-Sent Events.

- The request waits (off the worker) for its first decoding round before any byte is sent, so anything
  that goes wrong up to then (timeout in the queue, an engine failure at prefill) is a proper HTTP status.
- After that, a stream carries `data: {chunk}` events and ends with `data: [DONE]`; an error mid-stream is
  sent as a last `data: {"error": ...}` event, then `[DONE]`.
- A client that goes away cancels its job; the worker stops it between two decoding rounds.
- A request is one job per prompt (completions may send a batch), each with its n choices; the JSON answer
  waits for all of them, a stream (one prompt) interleaves its choices' chunks as their rounds finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from service.api.errors import CLIENT_CLOSED_REQUEST, SERVER, APIError, queue_full, sse_error_event
from service.api.events import DoneEvent, ErrorEvent, Event, GenerationPlan, Job, PromptEvent, StepEvent
from service.api.formatters import ChoiceResult, Formatter, PromptResult, request_stats
from service.api.state import ServiceState
from service.api.worker import EngineWorker
from service.decoding.requests import QueueFull

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def admit(state: ServiceState, worker: EngineWorker, plan: GenerationPlan, arrived: float) -> Job:
    deadline = arrived + state.settings.request_timeout_s
    job = Job(plan, asyncio.get_running_loop(), deadline, arrived=arrived)
    try:
        worker.submit(job)
    except QueueFull as full:
        raise queue_full(full.retry_after_s, full.running, full.waiting) from None
    return job


def refuse_if_full(worker: EngineWorker, rows: int) -> None:
    """A 429 before any work on the prompt (templating, tokenizing, compiling a grammar), when a request of
    `rows` batch rows would be refused anyway: under load, that work waits for the engine thread's share of
    the CPU, and a client told to back off should hear it at once."""
    if rows > worker.core.max_batch_size:  # can never fit: planning answers it with a 400, not a retry
        return
    try:
        worker.check_room(rows)
    except QueueFull as full:
        raise queue_full(full.retry_after_s, full.running, full.waiting) from None


@contextlib.asynccontextmanager
async def cancel_on_disconnect(
    request: Request, worker: EngineWorker, jobs: list[Job]
) -> AsyncIterator[None]:
    """While inside, a client disconnect cancels the jobs (the body was read already, so the next ASGI
    message can only be the disconnect)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for job in jobs:
                    worker.cancel(job, "client disconnected")
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def next_event(worker: EngineWorker, job: Job) -> Event:
    if job.cancelled and job.cancel_reason == "client disconnected":
        raise APIError(CLIENT_CLOSED_REQUEST, "the client disconnected", code="cancelled")
    try:
        return await job.next_event()
    except APIError:  # the deadline passed: stop the work too
        worker.cancel(job, "timeout")
        raise


async def respond(
    request: Request,
    state: ServiceState,
    worker: EngineWorker,
    plans: list[GenerationPlan],
    formatter: Formatter,
    stream: bool,
    arrived: float,
) -> Response:
    """`arrived`: time.monotonic() when the request came in; its timeout and latency metrics count from it.
    A stream takes one plan."""
    jobs: list[Job] = []
    try:
        for plan in plans:
            jobs.append(admit(state, worker, plan, arrived))
        async with cancel_on_disconnect(request, worker, jobs):
            if stream:
                first = await next_event(worker, jobs[0])
                if isinstance(first, ErrorEvent):
                    raise first.error
            else:
                results = [await collect(worker, job) for job in jobs]
                return JSONResponse(formatter.response(results))
    except BaseException:
        for job in jobs:
            worker.cancel(job, "request failed")
        raise
    return StreamingResponse(
        _stream(worker, jobs[0], formatter, first), media_type="text/event-stream", headers=SSE_HEADERS
    )


def _new_result(plan: GenerationPlan) -> PromptResult:
    return PromptResult(plan, [ChoiceResult(index=i) for i in range(plan.n)])


async def collect(worker: EngineWorker, job: Job) -> PromptResult:
    result = _new_result(job.plan)
    while not result.done:
        event = await next_event(worker, job)
        if isinstance(event, ErrorEvent):
            raise event.error
        if isinstance(event, PromptEvent):
            result.prompt = event
        elif isinstance(event, StepEvent):
            result.choices[event.index].add_step(event)
        elif isinstance(event, DoneEvent):
            result.choices[event.index].finish(event)
    return result


async def _stream(worker: EngineWorker, job: Job, formatter: Formatter, first: Event) -> AsyncIterator[bytes]:
    finished = False
    result = _new_result(job.plan)
    try:
        usage = formatter.with_usage  # the usage so far on every chunk, when the request asked
        for chunk in formatter.opening_chunks():
            yield sse(usage(chunk))
        event = first
        while True:
            if isinstance(event, PromptEvent):
                for chunk in formatter.prompt_chunks(event):
                    yield sse(usage(chunk))
            elif isinstance(event, StepEvent):
                formatter.count(event)
                for chunk in formatter.step_chunks(event):
                    yield sse(usage(chunk))
            elif isinstance(event, DoneEvent):
                result.choices[event.index].finish(event)
                for chunk in formatter.finish_chunks(event.index, event.finish_reason, event.stats):
                    yield sse(usage(chunk))
                if result.done:
                    if formatter.include_usage:
                        yield sse(formatter.usage_chunk(request_stats([result])))
                    yield DONE
                    finished = True
                    return
            elif isinstance(event, ErrorEvent):
                raise event.error
            event = await next_event(worker, job)
    except APIError as error:
        finished = True
        worker.cancel(job, "failed")
        yield sse_error_event(error)
        yield DONE
    except Exception:  # a bug while formatting a chunk: the stream still ends with an error event, not a cut
        logging.getLogger(__name__).exception("a stream failed after it began")
        finished = True
        worker.cancel(job, "failed")
        yield sse_error_event(
            APIError(
                500,
                "the stream failed on the server (details in the server log)",
                type=SERVER,
                code="internal_error",
            )
        )
        yield DONE
    finally:
        # The client went away (Starlette cancels this generator when it hears the disconnect).
        if not finished:
            worker.cancel(job, "client disconnected")
