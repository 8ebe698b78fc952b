"""The bridge between the event loop and the engine core: one thread runs model work, jobs carry events back.

The engine core (`service.decoding.engine.EngineCore`) schedules: its bounded queue, admission by batch rows,
the continuous batch, dropping finished and aborted work. This module only carries requests in and outputs
out: `submit` and `cancel` are called from the event loop; the thread steps the core, turns its outputs into
events (`OutputProcessor`), metrics (`StatLogger`) and traffic records, and hands each event to the loop that
waits for it (`loop.call_soon_threadsafe`). Nothing here runs torch on the event loop.

Faults: the core fails only the requests a fault touched and goes on. What it cannot go on from, a fault of
the loop itself or `MAX_CONSECUTIVE_FAULTS` faulty steps with no round succeeding between them, makes the
engine dead: every waiting and running request gets a 503 at once, new ones are refused, and `on_dead` tells
the service, which stops the process so that its supervisor restarts it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable

from service.api.errors import APIError, engine_dead, engine_failure, from_engine, shutting_down
from service.api.events import ErrorEvent, GenerationPlan, Job
from service.api.metrics import ServiceMetrics
from service.api.output_processor import OutputProcessor
from service.api.stat_logger import StatLogger
from service.decoding.batch import DEFAULT_MAX_BATCHED_TOKENS
from service.decoding.engine import Engine, EngineCore
from service.decoding.requests import (
    EngineClosed,
    Failed,
    FailReason,
    Finished,
    Output,
    PromptScored,
    RoundDecoded,
)
from service.traffic import traffic_record

log = logging.getLogger(__name__)

# Steps in a row that failed requests for an engine fault with no round succeeding between them, after which
# the engine is taken for dead. One is a request's own fault or a transient (an allocation that failed once);
# this many with nothing succeeding between them is a model or device that no longer works (a CUDA error
# poisons every later call), which only a restart cures. The readiness probe's success resets the count.
MAX_CONSECUTIVE_FAULTS = 5


class EngineWorker:
    """Owns the engine thread. `submit`, `cancel`, `between_rounds`, `end_all` and `stop` are called from the
    event loop (or any thread)."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServiceMetrics,
        max_queue: int,
        on_forward_ok: Callable[[], None] = lambda: None,
        max_batch_size: int = 1,
        max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
        idle_work: Callable[[], bool] | None = None,
        record: Callable[[dict], None] | None = None,
        model_identity: str = "",
        on_dead: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.engine = engine
        self.core = EngineCore(engine, max_batch_size, max_queue, max_batched_tokens)
        self.metrics = metrics
        self.stats = StatLogger(metrics)
        self.outputs = OutputProcessor(engine.target.tokenizer)
        self.on_forward_ok = on_forward_ok
        # opt-in traffic recording (service/traffic.py): it only queues, so this thread never waits on a disk
        self._record = record
        self._model_identity = model_identity  # name@revision, what a recorded record was answered by
        # model work that may run only while no request does (the rest of a cost measurement): one slice per
        # call, True while more is left. On this thread, so it never races a request's forward.
        self._idle_work = idle_work
        self._between: list[tuple[Callable[[], object], concurrent.futures.Future]] = []  # (fn, its future)
        self._jobs: dict[str, Job] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stopping = False
        self.on_dead = on_dead  # called on this thread, once, with why the engine cannot go on
        self._dead: str | None = None
        self._faults = 0  # faulty steps since the last round that succeeded
        self._thread = threading.Thread(target=self._run, name="csd-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ event-loop side

    @property
    def running(self) -> int:
        return self.core.num_running

    @property
    def waiting(self) -> int:
        return self.core.num_waiting

    @property
    def dead(self) -> str | None:
        """Why the engine cannot go on, or None while it can. A thread that ended without being stopped is
        dead too, however it ended."""
        ended = self._thread.ident is not None and not self._thread.is_alive()
        if self._dead is None and ended and not self._stopping:
            return "the engine thread ended"
        return self._dead

    def _refusal(self) -> APIError:
        return engine_dead() if self._dead is not None else shutting_down()

    def check_room(self, rows: int) -> None:
        """Refuse a request of `rows` batch rows now (QueueFull) if it would be: before any prompt work."""
        if self._stopping:
            raise self._refusal()
        self.core.check_room(rows)

    def submit(self, job: Job, *, priority: bool = False) -> None:
        """Admit a job or raise QueueFull. `priority` (readiness probes) skips the line and the bound."""
        with self._lock:
            if self._stopping:
                raise self._refusal()
            job.request_id = f"req-{next(self._ids)}"
            self._jobs[job.request_id] = job
        try:
            self.core.add(job.request_id, job.plan, deadline=job.deadline, priority=priority)
        except BaseException as exc:
            with self._lock:
                self._jobs.pop(job.request_id, None)
            if isinstance(exc, EngineClosed):
                raise self._refusal() from None
            raise
        self.metrics.requests_waiting.set(self.core.num_waiting)

    def cancel(self, job: Job, reason: str) -> None:
        """Stop a job: off the queue now, out of the batch before the next round."""
        if job.cancel(reason) and job.request_id:
            self.core.abort(job.request_id)

    def between_rounds(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread after the round in progress and before the next one (or at once
        when idle); the future gives its result or exception. Nothing in flight is dropped."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopping:
                future.set_exception(self._refusal())
                return future
            self._between.append((fn, future))
        self.core.wake()
        return future

    def end_all(self, error: APIError) -> int:
        """Answer every waiting and running job with `error` now (without waiting for the round in
        progress) and stop them; the core drops them between rounds. Returns how many."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.deliver(ErrorEvent(error))
            self.cancel(job, "shutdown")
        return len(jobs)

    def stop(self, timeout: float = 5.0) -> None:
        """Refuse new work, stop what waits and what runs (503 shutting down), and wait for the thread."""
        with self._lock:
            self._stopping = True
            jobs = list(self._jobs.values())
        self.core.close()
        for job in jobs:
            self.cancel(job, "shutdown")
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a fault of the loop itself: neither its state nor the core's is sound
            log.critical("the engine loop failed; the engine is dead", exc_info=True)
            self._die(f"the engine loop failed ({type(exc).__name__})")

    def _serve(self) -> None:
        while True:
            self._wait_for_work()
            self._run_between()
            if self._stopping and self.core.idle:
                return
            step = self.core.step()
            if step.stats.ran:
                self.on_forward_ok()
            self.stats.scheduler(step.stats)  # before the events: a client that reads metrics sees this step
            for out in step.outputs:
                self._handle(out)
            if self._count_faults(step.outputs) >= MAX_CONSECUTIVE_FAULTS:
                log.critical("%d faulty engine steps in a row; the engine is dead", self._faults)
                self._die(f"{self._faults} faulty steps in a row, no round succeeding")
                return

    def _count_faults(self, outputs: list[Output]) -> int:
        """Faulty steps since the last one that got a round of tokens out."""
        if any(isinstance(out, RoundDecoded) for out in outputs):
            self._faults = 0
        elif any(isinstance(out, Failed) and out.reason is FailReason.ENGINE_ERROR for out in outputs):
            self._faults += 1
        return self._faults

    def _die(self, reason: str) -> None:
        """The engine cannot go on: refuse new work, answer every waiting and running request with a 503 now
        (none waits for its client's timeout), fail the work queued between rounds, and tell the service."""
        with self._lock:
            self._dead = reason
            self._stopping = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            between, self._between = self._between, []
        self.core.close()
        error = engine_dead()
        for job in jobs:
            job.deliver(ErrorEvent(error))
        for _, future in between:
            future.set_exception(error)
        self.on_dead(reason)

    def _wait_for_work(self) -> None:
        """Block while there is nothing to do, running idle work slices meanwhile."""
        while self.core.idle and not self._between and not self._stopping:
            if self._idle_work is None:
                self.core.wait_for_work()
                continue
            try:
                more = self._idle_work()
            except Exception:
                log.exception("idle work failed; dropping it")
                more = False
            if not more:
                self._idle_work = None

    def _run_between(self) -> None:
        with self._lock:
            pending, self._between = self._between, []
        for fn, future in pending:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _handle(self, out: Output) -> None:
        job = self._jobs.get(out.request_id)
        if job is None:  # answered and forgotten already (a delivery that failed, end_all)
            return
        plan = job.plan
        try:
            self.stats.output(plan, job.arrived, out)
            if isinstance(out, PromptScored):
                job.deliver(self.outputs.prompt(plan, out))
            elif isinstance(out, RoundDecoded):
                job.deliver(self.outputs.round(plan, out))
            elif isinstance(out, Finished):
                job.deliver(self.outputs.done(out))
                self._record_traffic(plan, out)
                if out.request_done:
                    self._forget(job)
            elif isinstance(out, Failed):
                # whoever cancelled has answered the client already; this only wakes a waiter
                job.deliver(ErrorEvent(from_engine(out.reason, out.message, job.cancel_reason)))
                self._forget(job)
        except Exception:
            log.exception("failed to deliver an engine output")
            job.deliver(ErrorEvent(engine_failure()))
            self.stats.left(plan, job.arrived, "error")
            self._forget(job)
            self.core.abort(job.request_id)

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(job.request_id, None)

    def _record_traffic(self, plan: GenerationPlan, out: Finished) -> None:
        if self._record is None or plan.internal or out.generation is None:
            return
        try:
            self._record(traffic_record(plan, out.index, out.generation, self._model_identity))
        except Exception:  # recording must never cost a request anything
            log.exception("could not record a finished generation")
