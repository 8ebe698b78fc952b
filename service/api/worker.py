"""The engine worker: the one thread that runs model work, and the bounded queue in front of it.

The worker drives a continuous batch (`service.decoding.batch.Batch`): up to `max_batch_size` generations
share every target forward; new requests join between rounds and finished ones leave. Beyond the batch, up
to `max_queue` requests wait, and the rest are refused at once (429 with Retry-After) instead of piling up.
Nothing here runs torch on the event loop; the worker hands events back through `loop.call_soon_threadsafe`.

Jobs are checked for cancellation (client gone, timeout, shutdown) between rounds: a cancelled request
leaves the batch within one round, and the others carry on untouched.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.api.errors import CLIENT_CLOSED_REQUEST, SERVER, UNAVAILABLE, APIError
from service.api.metrics import ServiceMetrics
from service.decoding import DecodingError, Engine, GenerationStats, SamplingParams, SpeculativeConfig
from service.decoding.batch import DEFAULT_MAX_BATCHED_TOKENS, Batch
from service.decoding.generation import Generation
from service.decoding.scoring import prompt_logprobs
from service.decoding.text import token_bytes
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
    n: int = 1  # choices of this prompt: one prefill, then one batch row each
    # completions' echo with logprobs: score the prompt too, with this many top alternatives per token
    prompt_logprobs: int | None = None
    generate: bool = True  # False: score the prompt only (max_tokens 0)
    echo_text: str | None = None  # completions' echo: the prompt as text

    @property
    def rows(self) -> int:
        """Batch rows the plan occupies."""
        return self.n if self.generate else 0

    def sampling_for(self, index: int) -> SamplingParams:
        """Choice `index`'s sampling: with a seed, each choice gets its own stream (seed + index)."""
        if index == 0 or self.sampling.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=(self.sampling.seed + index) % 2**64)

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
    index: int = 0  # the choice (0 .. n - 1)
    # with logprobs: the text and the own bytes of every token id the round's logprobs name
    logprob_texts: dict[int, str] | None = None
    logprob_bytes: dict[int, bytes] | None = None


@dataclass
class DoneEvent:
    finish_reason: str
    text: str
    stats: GenerationStats
    index: int = 0


@dataclass
class PromptEvent:
    """The prompt's own logprobs (echo with logprobs), before any step: per prompt token (logprob, top
    alternatives), None for the first."""

    tokens: list[int]
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None]
    texts: dict[int, str]


@dataclass
class ErrorEvent:
    error: APIError


Event = StepEvent | DoneEvent | ErrorEvent | PromptEvent


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
        self.finished_choices = 0  # choices that finished (stop, length), and the longest one's tokens
        self.max_generation_tokens = 0

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


@dataclass
class _Active:
    """A job whose generation is in the batch."""

    job: Job
    generation: Generation
    started: float
    last_round_end: float | None = None
    index: int = 0  # the job's choice this generation answers
    first_round_end: float | None = None  # when its first tokens came (prefill done), for vLLM's phases


class EngineWorker:
    """Owns the engine thread. `submit` and `cancel` are called from the event loop."""

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
    ) -> None:
        self.engine = engine
        # opt-in traffic recording (service/traffic.py): called with each finished generation's token ids;
        # it only queues them, so the engine thread never waits on a disk
        self._record = record
        self._model_identity = model_identity  # name@revision, what a recorded record was answered by
        # work that must run on this thread between two rounds (a drafter swap): (function, its future)
        self._between: list[tuple[Callable[[], object], concurrent.futures.Future]] = []
        # model work that may run only while no request does (the rest of a cost measurement): one slice
        # per call, True while more is left. On this thread, so it never races a request's forward.
        self._idle_work = idle_work
        self.metrics = metrics
        self.max_queue = max_queue
        self.max_batch_size = max_batch_size
        self.on_forward_ok = on_forward_ok
        self._batch = Batch(engine.target, engine.policy, max_batch_size, max_batched_tokens)
        self._lock = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[_Active] = []  # touched by the worker thread only (read elsewhere for counts)
        # jobs taken off the queue and not yet in `_active`: counted too, so admission is exact under a burst
        self._starting = 0
        self._stopping = False
        self._mean_job_seconds = 2.0  # moving average of job durations, for Retry-After
        self._thread = threading.Thread(target=self._run, name="csd-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ event-loop side

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job, *, priority: bool = False) -> None:
        """Admit a job or raise QueueFull. `priority` (readiness probes) skips the line and the bound."""
        with self._lock:
            if self._stopping:
                raise APIError(503, "the server is shutting down", type=UNAVAILABLE, code="shutting_down")
            # counted in batch rows: a request for n choices takes n
            in_system = sum(max(1, j.plan.rows) for j in self._waiting) + self._starting + self.running
            rows = max(1, job.plan.rows)
            if not priority and in_system + rows > self.max_batch_size + self.max_queue:
                raise QueueFull(self._retry_after(in_system))
            if priority:
                self._waiting.appendleft(job)
            else:
                self._waiting.append(job)
            self.metrics.requests_waiting.set(len(self._waiting))
            self._lock.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Stop a job: dropped from the queue now, or taken out of the batch before the next round."""
        with self._lock:
            if job.cancelled:
                return
            job.cancel_reason = reason
            job._cancelled.set()
            if job in self._waiting:  # never started: it leaves as an aborted request
                self._waiting.remove(job)
                self._record_left(job, "abort")
            self.metrics.requests_waiting.set(len(self._waiting))

    def _retry_after(self, in_system: int) -> int:
        # Roughly when a slot frees up: the batch finishes max_batch_size jobs per mean job time.
        ahead = max(1, in_system - self.max_batch_size - self.max_queue + 1)
        return int(min(60, max(1, math.ceil(self._mean_job_seconds * ahead / self.max_batch_size))))

    def between_rounds(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread after the round in progress and before the next one (or at once
        when idle); the future gives its result or exception. Nothing in flight is dropped."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopping:
                future.set_exception(
                    APIError(503, "the server is shutting down", type=UNAVAILABLE, code="shutting_down")
                )
                return future
            self._between.append((fn, future))
            self._lock.notify()
        return future

    def _run_between(self) -> None:
        with self._lock:
            pending, self._between = self._between, []
        for fn, future in pending:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def end_all(self, error: APIError) -> int:
        """Answer every waiting and running job with `error` now (from the event loop, without waiting for
        the round in progress) and stop them; the worker drops them between rounds. Returns how many."""
        with self._lock:
            jobs = list(self._waiting) + [a.job for a in list(self._active)]
            self._waiting.clear()
        for job in jobs:
            job.cancel_reason = "shutdown"
            job._cancelled.set()
            job._deliver(ErrorEvent(error))
        return len(jobs)

    def stop(self, timeout: float = 5.0) -> None:
        """Refuse new work, cancel what waits and what runs, and wait for the thread."""
        with self._lock:
            self._stopping = True
            pending = list(self._waiting)
            self._waiting.clear()
            running = [a.job for a in self._active]
            self._lock.notify_all()
        shutting_down = APIError(503, "the server is shutting down", type=UNAVAILABLE, code="shutting_down")
        for job in pending:
            job._cancelled.set()
            job._deliver(ErrorEvent(shutting_down))
        for job in running:
            job.cancel_reason = "shutdown"
            job._cancelled.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------ worker thread

    def _run(self) -> None:
        while True:
            if not self._admit():
                return
            self._run_between()
            self._drop_stopped()
            if not self._active:
                continue
            try:
                results = self._batch.step()
            except Exception:  # the thread must survive anything: it is the only one that generates
                log.exception("engine failed during a batched round; failing the batch's requests")
                for active in self._active:
                    active.job._deliver(ErrorEvent(_engine_failure()))
                    self._record_left(active.job, "error")
                self._active = []
                self._batch.clear()
                self._set_running()
                continue
            self.on_forward_ok()
            if results:
                self.metrics.batch_rows.observe(len(results) + len(self._batch.failed))
            now = time.monotonic()
            by_generation = {id(a.generation): a for a in self._active}
            finished: list[_Active] = []
            for generation, error in self._batch.failed:  # the batch already dropped them
                active = by_generation[id(generation)]
                active.job._deliver(ErrorEvent(_generation_error(error)))
                self._record_left(active.job, "error")
                finished.append(active)
            for generation, step in results:
                active = by_generation[id(generation)]
                try:
                    self._deliver_step(active, step, now)
                except Exception:
                    log.exception("failed to deliver a generation step")
                    active.job._deliver(ErrorEvent(_engine_failure()))
                    self._record_left(active.job, "error")
                    self._batch.remove(generation)
                    finished.append(active)
                    continue
                if step.finish_reason is not None:
                    self._finish(active, now)
                    finished.append(active)
            if finished:
                self._active = [a for a in self._active if a not in finished]
                self._set_running()

    def _admit(self) -> bool:
        """Move waiting jobs into the batch while it has room; block while there is nothing to do.
        False when the worker must stop."""
        with self._lock:
            while not self._waiting and not self._active and not self._stopping and not self._between:
                if self._idle_work is None:
                    self._lock.wait()
                    continue
                self._lock.release()  # submit() must not wait for the slice
                try:
                    more = self._idle_work()
                except Exception:
                    log.exception("idle work failed; dropping it")
                    more = False
                finally:
                    self._lock.acquire()
                if not more:
                    self._idle_work = None
            if self._stopping and not self._active:
                return False
            taken: list[Job] = []
            taken_rows = 0
            while self._waiting:
                rows = self._waiting[0].plan.rows
                if rows > self.max_batch_size:  # could never fit (planning checks it): answer, never wait
                    job = self._waiting.popleft()
                    job._deliver(ErrorEvent(APIError(400, "n is above this server's batch size", param="n")))
                    continue
                if rows > self._batch.room() - taken_rows or taken_rows + rows + len(self._active) > (
                    self.max_batch_size
                ):
                    break
                taken.append(self._waiting.popleft())
                taken_rows += rows
            self._starting += taken_rows
            self.metrics.requests_waiting.set(len(self._waiting))
        for job in taken:
            try:
                # into `_active` (or answered with an error) before it stops counting as starting
                self._start(job)
            finally:
                with self._lock:
                    self._starting -= job.plan.rows
        self._set_running()
        return True

    def _start(self, job: Job) -> None:
        plan = job.plan
        try:
            if plan.prompt_logprobs is not None:
                job._deliver(self._score_prompt(plan))
            if not plan.generate:  # echo with max_tokens 0: every choice is the scored prompt alone
                for index in range(plan.n):
                    job._deliver(
                        DoneEvent("length", "", GenerationStats(prompt_tokens=len(plan.prompt_ids)), index)
                    )
                return
            generations = [
                self.engine.generate(plan.prompt_ids, plan.sampling_for(i), plan.spec, drafter=plan.drafter)
                for i in range(plan.n)
            ]
            self._batch.add_group(generations)
        except DecodingError as exc:
            job._deliver(ErrorEvent(APIError(400, str(exc), code="invalid_value")))
            return
        except Exception:
            log.exception("engine failed to start a generation")
            job._deliver(ErrorEvent(_engine_failure()))
            return
        if not plan.internal:
            self.metrics.record_start(plan.method, plan.drafter_label, len(plan.prompt_ids))
        started = time.monotonic()
        self._active.extend(_Active(job, g, started, index=i) for i, g in enumerate(generations))

    def _score_prompt(self, plan: GenerationPlan) -> PromptEvent:
        top_n = plan.prompt_logprobs or 0
        scored = prompt_logprobs(self.engine.target, plan.prompt_ids, top_n)
        ids = set(plan.prompt_ids) | {i for entry in scored if entry for i, _ in entry[1]}
        return PromptEvent(list(plan.prompt_ids), scored, self._texts(ids))

    def _texts(self, ids: set[int]) -> dict[int, str]:
        """Token id -> its text (one tokenizer call for all)."""
        ordered = sorted(ids)
        texts = self.engine.target.tokenizer.batch_decode([[i] for i in ordered])
        return dict(zip(ordered, texts, strict=True))

    def _drop_stopped(self) -> None:
        """Cancelled or timed-out jobs leave the batch before the next round."""
        now = time.monotonic()
        kept: list[_Active] = []
        for active in self._active:
            job = active.job
            if job.cancelled or now > job.deadline:
                # Whoever cancelled has answered the client already; the event only wakes a waiter.
                log.debug("job stopped between rounds: %s", job.cancel_reason or "timeout")
                self._batch.remove(active.generation)
                job._deliver(ErrorEvent(_stopped(job.cancel_reason or "timeout")))
                self._record_left(job, "abort")
            else:
                kept.append(active)
        if len(kept) != len(self._active):
            self._active = kept
            self._set_running()

    def _set_running(self) -> None:
        self.metrics.set_running(len(self._active))

    def _record_left(self, job: Job, finished_reason: str) -> None:
        """A request that leaves without finishing (abort, error), for vLLM's request_success counter."""
        if not job.plan.internal:
            self.metrics.record_finish(
                job.plan.method, job.plan.drafter_label, finished_reason, arrived=job.arrived,
                now=time.monotonic(),
            )  # fmt: skip

    def _deliver_step(self, active: _Active, step: GenerationStep, now: float) -> None:
        job, plan = active.job, active.job.plan
        if not plan.internal:
            since_last = None if active.last_round_end is None else now - active.last_round_end
            self.metrics.record_step(plan.method, plan.drafter_label, step, now - job.arrived, since_last)
        if active.first_round_end is None:
            active.first_round_end = now
            if not plan.internal and active.index == 0:  # a request's choices share one prefill
                stats = active.generation.stats
                self.metrics.record_prefix_cache(stats.prompt_tokens, stats.cached_tokens)
        active.last_round_end = now
        token_texts = None
        if plan.return_provenance:
            tokenizer = self.engine.target.tokenizer
            # one tokenizer call per round for all its tokens (and the draft tokens they replaced)
            texts = tokenizer.batch_decode([[t.token_id] for t in step.tokens])
            replaced = [t for t in step.tokens if t.replaced_token_id is not None]
            replaced_texts = iter(tokenizer.batch_decode([[t.replaced_token_id] for t in replaced]))
            token_texts = [
                (text, None if t.replaced_token_id is None else next(replaced_texts))
                for t, text in zip(step.tokens, texts, strict=True)
            ]
        logprob_texts = logprob_bytes = None
        if plan.sampling.logprobs is not None:
            ids = {t.token_id for t in step.tokens} | {i for t in step.tokens for i, _ in t.top_logprobs}
            logprob_texts = self._texts(ids)
            logprob_bytes = token_bytes(self.engine.target.tokenizer, sorted(ids))
        job._deliver(
            StepEvent(
                step.text,
                len(step.tokens),
                step.finish_reason,
                list(step.tokens),
                token_texts,
                step.round.num_draft_tokens,
                index=active.index,
                logprob_texts=logprob_texts,
                logprob_bytes=logprob_bytes,
            )
        )

    def _finish(self, active: _Active, now: float) -> None:
        job, plan, generation = active.job, active.job.plan, active.generation
        if not plan.internal:
            self.metrics.record_finish(
                plan.method,
                plan.drafter_label,
                generation.finish_reason or "stop",
                arrived=job.arrived,
                started=active.started,
                first_token=active.first_round_end,
                now=now,
                prompt_tokens=len(plan.prompt_ids),
                generation_tokens=generation.stats.completion_tokens,
            )
            job.finished_choices += 1
            job.max_generation_tokens = max(job.max_generation_tokens, generation.stats.completion_tokens)
            if job.finished_choices == plan.n:
                self.metrics.record_request_finish(plan.method, plan.drafter_label, job.max_generation_tokens)
        job._deliver(
            DoneEvent(
                generation.finish_reason or "stop", generation.text, generation.stats, index=active.index
            )
        )
        if self._record is not None and not plan.internal:
            try:
                self._record(self._traffic_record(active))
            except Exception:  # recording must never cost a request anything
                log.exception("could not record a finished generation")
        self._mean_job_seconds = 0.8 * self._mean_job_seconds + 0.2 * (now - active.started)

    def _traffic_record(self, active: _Active) -> dict:
        """What fine-tuning needs of one finished generation (service/traffic.py): token ids, no text."""
        plan, generation = active.job.plan, active.generation
        answer = [t.token_id for t in generation.tokens]
        stats = generation.stats
        # It ended on its end-of-turn token, which the emitted tokens leave out: appended when there is only
        # one it could be (a request's stop_token_ids add others, and which one ended it is not kept).
        end_known = not stats.num_eos or len(generation.eos_ids) == 1
        if stats.num_eos and end_known:
            answer.extend(generation.eos_ids)
        drafter = generation.drafter
        return {
            "v": 1,
            "time": round(time.time(), 3),
            "model": self._model_identity,
            "method": plan.method,
            "drafter": plan.drafter_label,
            "drafter_identity": drafter.identity if drafter is not None else None,
            "temperature": plan.sampling_for(active.index).temperature,
            "finish_reason": generation.finish_reason or "stop",
            "ended_on_end_token": bool(stats.num_eos),
            "end_token_known": end_known,
            "prompt_ids": list(plan.prompt_ids),
            "answer_ids": answer,
            "target_forwards": stats.target_forwards,
            "draft_tokens": stats.num_draft_tokens,
            "accepted_tokens": stats.num_accepted,
        }


def _stopped(reason: str) -> APIError:
    if reason == "timeout":
        return APIError(504, "the request timed out", type="timeout_error", code="timeout")
    if reason == "shutdown":
        return APIError(503, "the server is shutting down", type=UNAVAILABLE, code="shutting_down")
    return APIError(CLIENT_CLOSED_REQUEST, f"generation stopped: {reason}", code="cancelled")


def _generation_error(error: Exception) -> APIError:
    if isinstance(error, DecodingError):
        return APIError(400, str(error), code="invalid_value")
    return _engine_failure()


def _engine_failure() -> APIError:
    return APIError(
        500,
        "the generation failed inside the engine; the server keeps serving (details in the server log)",
        type=SERVER,
        code="engine_error",
    )
