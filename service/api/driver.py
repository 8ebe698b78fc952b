"""The one response driver: every generation request, whatever its API (chat completions, completions, the
Responses API) and however it is answered (JSON, Server-Sent Events, or a background response that no
client waits on), runs through a `RequestRun`, and each API is a `Formatter` over the same events. This is
vLLM v1's shape: one output processor (`output_processor.py` turns the engine's outputs into events), and
serving layers that only format.

What happens to a request, written once here for every API:
- **Admission**: one job per prompt (completions may send a batch), each with its n choices, on the engine
  worker's queue; a full queue is a 429, before any work on the prompt where it can be (`refuse_if_full`).
- **The first round before the first byte**: a stream waits (off the engine thread) for its first event,
  so what goes wrong until then (a timeout in the queue, an engine failure at prefill) is an HTTP status.
- **Results and usage**: every event, streamed or not, is added to the request's `Results` (`results.py`);
  their totals are the usage every API reports (prompt tokens once per prompt, cached tokens once per
  prompt), and the usage so far of a stream.
- **Stop**: a request ends when every choice of every prompt has finished; the formatter then closes
  (a usage chunk, `response.completed`).
- **Errors**: after the first byte, an error (the engine's, the deadline's) ends the stream with the
  formatter's error chunks; a bug while formatting does the same as an `internal_error`, never a cut stream.
- **Cancellation**: a client that goes away (while its JSON answer is awaited, or mid-stream), a deadline
  that passes, a failure, or an explicit cancel (a background response's) stops the jobs; the worker drops
  them between two decoding rounds, and the engine counts an abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from service.api.errors import CLIENT_CLOSED_REQUEST, SERVER, APIError, queue_full
from service.api.events import DoneEvent, ErrorEvent, Event, GenerationPlan, Job, PromptEvent, RoundEvent
from service.api.results import Results
from service.api.state import ServiceState
from service.api.worker import EngineWorker
from service.decoding.requests import QueueFull

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = "client disconnected"


def sse(data: dict, event: str | None = None) -> bytes:
    """One Server-Sent Event: `data: {json}`, after an `event: <type>` line when it has a type."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class Formatter:
    """An API's shape over the driver's events. The driver adds each event to the request's `Results`, then
    asks for the chunks it makes (dicts, framed by `frame`); the JSON answer is `response`. A formatter may
    keep state between calls (a tool-call parser, the output items being written)."""

    end_of_stream = b""  # sent after the last chunk (chat and completions: `data: [DONE]`)

    def opening_chunks(self) -> list[dict]:
        return []

    def prompt_chunks(self, event: PromptEvent) -> list[dict]:
        return []

    def round_chunks(self, event: RoundEvent) -> list[dict]:
        return []

    def finish_chunks(self, event: DoneEvent) -> list[dict]:
        """One choice has finished."""
        return []

    def closing_chunks(self, results: Results) -> list[dict]:
        """Every choice has finished: `results.totals()` is the request's usage."""
        return []

    def error_chunks(self, error: APIError) -> list[dict]:
        """The request failed (after the first byte of a stream, or in the background)."""
        raise NotImplementedError

    def frame(self, chunk: dict, results: Results) -> bytes:
        return sse(chunk)

    def response(self, results: Results) -> dict:
        """The JSON answer, from a request's finished results."""
        raise NotImplementedError


def _event_chunks(formatter: Formatter, event: Event) -> list[dict]:
    if isinstance(event, RoundEvent):
        return formatter.round_chunks(event)
    if isinstance(event, DoneEvent):
        return formatter.finish_chunks(event)
    if isinstance(event, PromptEvent):
        return formatter.prompt_chunks(event)
    raise TypeError(f"not an output event: {event!r}")


def failure(exc: Exception) -> APIError:
    """What a request that failed after it began tells its client: its APIError, or for anything else (a
    bug) an internal error whose details go to the server log only."""
    if isinstance(exc, APIError):
        return exc
    log.error("a request failed after it began", exc_info=exc)
    return APIError(
        500,
        "the generation failed on the server (details in the server log)",
        type=SERVER,
        code="internal_error",
    )


class RequestRun:
    """One request on the engine: its jobs (one per prompt), its results as the events arrive, and the one
    way each of its ends (finished, failed, timed out, abandoned, cancelled) stops its work.

    `abandoned`: the cancel reason when nobody reads the stream any more (its client went away; for a
    background response, its task was cancelled)."""

    def __init__(
        self, worker: EngineWorker, plans: list[GenerationPlan], abandoned: str = CLIENT_GONE
    ) -> None:
        self.worker = worker
        self.plans = plans
        self.jobs: list[Job] = []
        self.results = Results(plans)
        self.abandoned = abandoned

    @classmethod
    def admit(
        cls,
        state: ServiceState,
        worker: EngineWorker,
        plans: list[GenerationPlan],
        arrived: float,
        abandoned: str = CLIENT_GONE,
    ) -> RequestRun:
        """Submit one job per plan; a full queue is a 429. `arrived`: time.monotonic() when the request came
        in; its deadline and latency metrics count from it."""
        run = cls(worker, plans, abandoned)
        deadline = arrived + state.settings.request_timeout_s
        loop = asyncio.get_running_loop()
        try:
            for plan in plans:
                job = Job(plan, loop, deadline, arrived=arrived)
                worker.submit(job)
                run.jobs.append(job)
        except BaseException as exc:
            run.cancel("request failed")
            if isinstance(exc, QueueFull):
                raise queue_full(exc.retry_after_s, exc.running, exc.waiting) from None
            raise
        return run

    def cancel(self, reason: str) -> None:
        """Stop every job (those that finished already are not touched)."""
        for job in self.jobs:
            self.worker.cancel(job, reason)

    async def _next(self, prompt: int) -> Event:
        """The next output event of one prompt's job, added to the results; an error event, a disconnect
        heard meanwhile or the deadline (which stops the job too) raise APIError."""
        job = self.jobs[prompt]
        if job.cancelled and job.cancel_reason == CLIENT_GONE:
            raise APIError(CLIENT_CLOSED_REQUEST, "the client disconnected", code="cancelled")
        try:
            event = await job.next_event()
        except APIError:  # the deadline passed
            self.worker.cancel(job, "timeout")
            raise
        if isinstance(event, ErrorEvent):
            raise event.error
        self.results.prompts[prompt].add(event)
        return event

    async def first_event(self) -> Event:
        """A stream's first event (a stream has one prompt): awaited before the first byte is sent."""
        return await self._next(0)

    async def collect(self) -> Results:
        """Every prompt's events to the end (the JSON answer)."""
        for prompt, result in enumerate(self.results.prompts):
            while not result.done:
                await self._next(prompt)
        return self.results

    async def chunks(self, formatter: Formatter, first: Event) -> AsyncIterator[dict]:
        """A stream as the formatter's chunks, from `first` to the request's end: its closing chunks when
        every choice finished, its error chunks when it failed. Closed before its end (the client went
        away, the task was cancelled), it stops the work."""
        ended = False
        try:
            for chunk in formatter.opening_chunks():
                yield chunk
            event = first
            while True:
                for chunk in _event_chunks(formatter, event):
                    yield chunk
                if self.results.done:
                    ended = True
                    for chunk in formatter.closing_chunks(self.results):
                        yield chunk
                    return
                event = await self._next(0)
        except Exception as exc:
            ended = True
            self.cancel("failed")
            for chunk in formatter.error_chunks(failure(exc)):
                yield chunk
        finally:
            if not ended:
                self.cancel(self.abandoned)


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, run: RequestRun) -> AsyncIterator[None]:
    """While inside, a client disconnect cancels the run (the body was read already, so the next ASGI
    message can only be the disconnect)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                run.cancel(CLIENT_GONE)
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def respond(request: Request, run: RequestRun, formatter: Formatter, stream: bool) -> Response:
    """Answer an admitted request: the JSON response once every choice finished, or (one prompt) a stream
    that begins once the first round ran. Until the first byte, an error is an HTTP status."""
    try:
        async with cancel_on_disconnect(request, run):
            if not stream:
                return JSONResponse(formatter.response(await run.collect()))
            first = await run.first_event()
    except BaseException:
        run.cancel("request failed")
        raise
    return StreamingResponse(_sse(run, formatter, first), media_type="text/event-stream", headers=SSE_HEADERS)


async def _sse(run: RequestRun, formatter: Formatter, first: Event) -> AsyncIterator[bytes]:
    # aclosing: when Starlette drops this stream (the client went away), the chunks' own cleanup runs now
    async with contextlib.aclosing(run.chunks(formatter, first)) as chunks:
        async for chunk in chunks:
            yield formatter.frame(chunk, run.results)
    if formatter.end_of_stream:
        yield formatter.end_of_stream


async def run_to_end(run: RequestRun, formatter: Formatter, started: Callable[[], None]) -> None:
    """A request no client waits on (a background response): the same events through the same formatter,
    its chunks dropped; the formatter keeps what it needs. `started` is called once the first round ran."""
    try:
        first = await run.first_event()
        started()
    except Exception as exc:
        run.cancel("failed")
        formatter.error_chunks(failure(exc))
        return
    async with contextlib.aclosing(run.chunks(formatter, first)) as chunks:
        async for _ in chunks:
            pass


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
