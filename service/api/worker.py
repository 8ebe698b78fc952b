"""The engine worker: the one thread that runs model work, and the bounded queue in front of it.

The engine runs one generation round at a time on the CPU, so requests take turns: one generation runs,
up to `max_queue` wait, and the rest are refused at once (429 with Retry-After) instead of piling up.
Nothing here runs torch on the event loop; the worker hands events back through `loop.call_soon_threadsafe`.

A job is checked for cancellation (client gone, timeout, shutdown) between rounds, so a cancelled request
stops within one decoding round.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.api.errors import CLIENT_CLOSED_REQUEST, SERVER, UNAVAILABLE, APIError
from service.api.metrics import ServiceMetrics
from service.decoding import DecodingError, Engine, GenerationStats, SamplingParams, SpeculativeConfig
from service.decoding.types import EmittedToken, GenerationStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationPlan:
    """A request turned into what the engine needs; validated before it reaches the queue."""

    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpeculativeConfig
    drafter: str  # the engine's drafter name ("ngram", "model")
    return_provenance: bool = False
    internal: bool = False  # a readiness probe: proves the engine works, counts in no metric

    @property
    def method(self) -> str:
        return self.spec.method.value

    @property
    def drafter_label(self) -> str:
        """The drafter for metrics and responses: "none" when the method does not speculate."""
        return self.drafter if self.spec.speculates else "none"


@dataclass
class StepEvent:
    """One decoding round's output."""

    text: str
    num_tokens: int
    finish_reason: str | None
    tokens: list[EmittedToken] = field(default_factory=list)
    token_texts: list[tuple[str, str | None]] | None = None  # (text, replaced text), when asked for
    draft_tokens: int = 0  # draft tokens this round verified, so a client can show live acceptance


@dataclass
class DoneEvent:
    finish_reason: str
    text: str
    stats: GenerationStats


@dataclass
class ErrorEvent:
    error: APIError


Event = StepEvent | DoneEvent | ErrorEvent


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__("queue full")
        self.retry_after_s = retry_after_s


class Job:
    """One admitted generation. Events arrive on `events` (an asyncio queue of the submitting loop)."""

    def __init__(
        self,
        plan: GenerationPlan,
        loop: asyncio.AbstractEventLoop,
        deadline: float,
        arrived: float | None = None,
    ) -> None:
        self.plan = plan
        self.loop = loop
        self.deadline = deadline  # time.monotonic() by which the job must be done
        self.arrived = arrived if arrived is not None else time.monotonic()  # when the request came in
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.cancel_reason = ""

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _deliver(self, event: Event) -> None:
        # RuntimeError: the loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next_event(self) -> Event:
        """The next event; raises APIError(504) at the deadline (and cancels the job)."""
        remaining = self.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(self.events.get(), timeout=max(remaining, 0.001))
        except asyncio.TimeoutError:
            raise APIError(
                504,
                "the request timed out before its generation finished",
                type="timeout_error",
                code="timeout",
            ) from None


class EngineWorker:
    """Owns the engine thread. `submit` and `cancel` are called from the event loop."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServiceMetrics,
        max_queue: int,
        on_forward_ok: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.on_forward_ok = on_forward_ok
        self._lock = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._stopping = False
        self._mean_job_seconds = 2.0  # moving average of job durations, for Retry-After
        self._thread = threading.Thread(target=self._run, name="csd-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ event-loop side

    @property
    def running(self) -> int:
        return 1 if self._running is not None else 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job, *, priority: bool = False) -> None:
        """Admit a job or raise QueueFull. `priority` (readiness probes) skips the line and the bound."""
        with self._lock:
            if self._stopping:
                raise APIError(503, "the server is shutting down", type=UNAVAILABLE, code="shutting_down")
            in_system = len(self._waiting) + self.running
            if not priority and in_system > self.max_queue:
                raise QueueFull(self._retry_after(in_system))
            if priority:
                self._waiting.appendleft(job)
            else:
                self._waiting.append(job)
            self.metrics.requests_waiting.set(len(self._waiting))
            self._lock.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Stop a job: dropped from the queue now, or stopped by the worker after the current round."""
        with self._lock:
            if job.cancelled:
                return
            job.cancel_reason = reason
            job._cancelled.set()
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)
            self.metrics.requests_waiting.set(len(self._waiting))

    def _retry_after(self, in_system: int) -> int:
        # Roughly when a slot frees up: the queue ahead drains one job per mean job time.
        return int(min(60, max(1, math.ceil(self._mean_job_seconds * max(1, in_system - self.max_queue)))))

    def stop(self, timeout: float = 5.0) -> None:
        """Refuse new work, cancel what waits and what runs, and wait for the thread."""
        with self._lock:
            self._stopping = True
            pending = list(self._waiting)
            self._waiting.clear()
            running = self._running
            self._lock.notify_all()
        shutting_down = APIError(503, "the server is shutting down", type=UNAVAILABLE, code="shutting_down")
        for job in pending:
            job._cancelled.set()
            job._deliver(ErrorEvent(shutting_down))
        if running is not None:
            running.cancel_reason = "shutdown"
            running._cancelled.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------ worker thread

    def _next_job(self) -> Job | None:
        with self._lock:
            while not self._waiting and not self._stopping:
                self._lock.wait()
            if self._stopping:
                return None
            job = self._waiting.popleft()
            self._running = job
            self.metrics.requests_waiting.set(len(self._waiting))
            self.metrics.requests_running.set(1)
            return job

    def _run(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            started = time.monotonic()
            try:
                self._generate(job)
            except Exception:  # the thread must survive anything: it is the only one that generates
                log.exception("engine worker failed on a job")
                job._deliver(ErrorEvent(_engine_failure()))
            finally:
                with self._lock:
                    self._running = None
                    self.metrics.requests_running.set(0)
                elapsed = time.monotonic() - started
                self._mean_job_seconds = 0.8 * self._mean_job_seconds + 0.2 * elapsed

    def _generate(self, job: Job) -> None:
        plan = job.plan
        method, drafter = plan.method, plan.drafter_label
        m = self.metrics if not plan.internal else None
        try:
            generation = self.engine.generate(plan.prompt_ids, plan.sampling, plan.spec, drafter=plan.drafter)
        except DecodingError as exc:
            job._deliver(ErrorEvent(APIError(400, str(exc), code="invalid_value")))
            return
        except Exception:
            log.exception("engine failed to start a generation")
            job._deliver(ErrorEvent(_engine_failure()))
            return
        if m is not None:
            m.prompt_tokens.labels(method, drafter).inc(len(plan.prompt_ids))
        tokenizer = self.engine.target.tokenizer
        steps = iter(generation)
        last_round_end: float | None = None
        try:
            while True:
                if job.cancelled or time.monotonic() > job.deadline:
                    # Whoever cancelled has answered the client already; the event only wakes a waiter.
                    log.debug("job stopped between rounds: %s", job.cancel_reason or "timeout")
                    job._deliver(ErrorEvent(_stopped(job.cancel_reason or "timeout")))
                    return
                try:
                    step: GenerationStep = next(steps)
                except StopIteration:
                    break
                now = time.monotonic()
                self.on_forward_ok()
                if m is not None:
                    self._record_step(m, method, drafter, step, now - job.arrived, last_round_end, now)
                last_round_end = now
                token_texts = None
                if plan.return_provenance:
                    token_texts = [
                        (
                            tokenizer.decode([t.token_id]),
                            None if t.replaced_token_id is None else tokenizer.decode([t.replaced_token_id]),
                        )
                        for t in step.tokens
                    ]
                job._deliver(
                    StepEvent(
                        step.text,
                        len(step.tokens),
                        step.finish_reason,
                        list(step.tokens),
                        token_texts,
                        step.round.num_draft_tokens,
                    )
                )
                if step.finish_reason is not None:
                    break
        except DecodingError as exc:
            job._deliver(ErrorEvent(APIError(400, str(exc), code="invalid_value")))
            return
        except Exception:
            log.exception("engine failed during a generation")
            job._deliver(ErrorEvent(_engine_failure()))
            return
        finally:
            steps.close()  # type: ignore[attr-defined]
        if m is not None:
            m.e2e.labels(method, drafter).observe(time.monotonic() - job.arrived)
        job._deliver(DoneEvent(generation.finish_reason or "stop", generation.text, generation.stats))

    @staticmethod
    def _record_step(
        m: ServiceMetrics,
        method: str,
        drafter: str,
        step: GenerationStep,
        since_arrival: float,
        last_round_end: float | None,
        now: float,
    ) -> None:
        m.record_round(method, drafter, step.round)
        if step.tokens:
            m.generation_tokens.labels(method, drafter).inc(len(step.tokens))
        if last_round_end is None:
            m.ttft.labels(method, drafter).observe(since_arrival)
        else:
            m.itl.labels(method, drafter).observe(now - last_round_end)


def _stopped(reason: str) -> APIError:
    if reason == "timeout":
        return APIError(504, "the request timed out", type="timeout_error", code="timeout")
    if reason == "shutdown":
        return APIError(503, "the server is shutting down", type=UNAVAILABLE, code="shutting_down")
    return APIError(CLIENT_CLOSED_REQUEST, f"generation stopped: {reason}", code="cancelled")


def _engine_failure() -> APIError:
    return APIError(
        500,
        "the generation failed inside the engine; the server keeps serving (details in the server log)",
        type=SERVER,
        code="engine_error",
    )
