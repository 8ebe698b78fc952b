"""The engine: `Engine` holds a target model with the drafters and memories it may use and starts
`Generation`s; `EngineCore` schedules them: `add(request)`, `abort(id)`, `step() -> outputs`.

The core is vLLM v1's EngineCore in our terms: a bounded queue (admission counted in batch rows) in front of
one continuous `Batch`; each `step()` admits what fits, drops what was aborted or ran out of time, runs one
round and returns plain data (`service.decoding.requests`). It knows nothing of asyncio, HTTP or metrics:
`add`/`abort`/`close` may be called from any thread, `step` from the one thread that runs model work.

Where things live: the per-sequence half of a round (draft budget, verification, emission) is
`generation.Generation`; the round itself, for all sequences of a batch (drafting, the draft cap, one target
forward, verification, rollback), is `batch.Batch._round`; drafters are in `drafters/`. Running a generation
alone is a batch of one, so a sequence served alone and one served among others go through the same code.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from service.decoding.batch import DEFAULT_MAX_BATCHED_TOKENS, Batch
from service.decoding.draft_policy import DraftPolicy
from service.decoding.drafters.base import Drafter
from service.decoding.generation import Generation
from service.decoding.prefix_cache import PrefixCache, prefix_caching_unsupported
from service.decoding.requests import (
    ChoiceTiming,
    CoreStep,
    EngineClosed,
    EngineRequest,
    Failed,
    FailReason,
    Finished,
    Output,
    PromptScored,
    QueueFull,
    RoundDecoded,
    SchedulerStats,
    Started,
)
from service.decoding.scoring import prompt_logprobs
from service.decoding.types import (
    DecodingError,
    GenerationRound,
    GenerationStats,
    SamplingParams,
    SpeculativeConfig,
)
from service.decoding.verification import CorrectionMemory
from service.executor.models import LoadedModel

log = logging.getLogger(__name__)


class Engine:
    """A target model plus the drafters and memory it may use; starts `Generation`s (the core schedules
    them)."""

    def __init__(
        self,
        target: LoadedModel,
        drafters: dict[str, Drafter] | None = None,
        memories: dict[str, CorrectionMemory] | None = None,
        policy: DraftPolicy | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.target = target
        self.drafters = drafters or {}
        self.memories = memories or {}  # drafter name -> the memory of the (target, drafter) pair
        # Without measured forward costs the policy verifies every draft in full (fixed speculation).
        self.policy = policy or DraftPolicy()
        if prefix_cache is not None:
            reason = prefix_caching_unsupported(target.model)
            if reason is not None:
                raise DecodingError(f"prefix caching cannot serve {target.name}: {reason}")
        # KV blocks of earlier prompts, shared by every generation of this engine (None: no prefix caching)
        self.prefix_cache = prefix_cache

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        spec: SpeculativeConfig,
        drafter: str = "ngram",
        record_strict: bool = False,
    ) -> Generation:
        chosen = None
        if spec.speculates:
            if drafter not in self.drafters:
                available = ", ".join(sorted(self.drafters)) or "none"
                raise DecodingError(f"drafter {drafter!r} is not available (available: {available})")
            chosen = self.drafters[drafter]
        return Generation(
            self.target,
            prompt_ids,
            sampling,
            spec,
            drafter=chosen,
            memory=self.memories.get(drafter),
            record_strict=record_strict,
            policy=self.policy,
            prefix_cache=self.prefix_cache,
        )


@dataclass
class _Queued:
    request_id: str
    request: EngineRequest
    deadline: float | None


@dataclass
class _Choice:
    generation: Generation
    index: int
    started: float
    first_tokens: float | None = None
    last_round_end: float | None = None


@dataclass
class _Running:
    queued: _Queued
    choices: list[_Choice]
    finished: int = 0
    max_generation_tokens: int = 0


class EngineCore:
    """The scheduler. Up to `max_batch_size` rows decode together; beyond them up to `max_queue` rows wait;
    `add` refuses the rest at once (`QueueFull`, with a Retry-After estimate) instead of letting them pile up."""

    def __init__(
        self,
        engine: Engine,
        max_batch_size: int = 1,
        max_queue: int = 0,
        max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
    ) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.batch = Batch(engine.target, engine.policy, max_batch_size, max_batched_tokens)
        self._cond = threading.Condition()
        # everything below is guarded by _cond
        self._waiting: collections.deque[_Queued] = collections.deque()
        self._starting: dict[str, _Queued] = {}  # taken off the queue by step(), not yet in the batch
        self._running: dict[str, _Running] = {}
        self._rows = 0  # rows of _starting and _running: admission counts them, so it is exact in a burst
        self._aborts: set[str] = set()  # to take out of the batch before the next round
        self._pending: list[Output] = []  # outputs made outside step() (a queued request aborted)
        self._closed = False
        self._woken = False
        self._mean_request_s = 2.0  # moving average of request durations, for Retry-After

    # ------------------------------------------------------------ any thread

    @property
    def num_running(self) -> int:
        """Batch rows decoding (or joining)."""
        return len(self.batch)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def check_room(self, rows: int) -> None:
        """Raise QueueFull when a request of `rows` rows would be refused now: lets a caller refuse before it
        does any work on the prompt."""
        with self._cond:
            self._check_room(max(1, rows))

    def add(
        self,
        request_id: str,
        request: EngineRequest,
        *,
        deadline: float | None = None,
        priority: bool = False,
    ) -> None:
        """Queue a request or raise QueueFull / EngineClosed. `priority` (readiness probes) skips the line and
        the bound. `deadline`: time.monotonic() after which it is dropped with FailReason.TIMEOUT."""
        with self._cond:
            if self._closed:
                raise EngineClosed()
            if not priority:
                self._check_room(max(1, request.rows))
            queued = _Queued(request_id, request, deadline)
            if priority:
                self._waiting.appendleft(queued)
            else:
                self._waiting.append(queued)
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        """Take a request out: off the queue now, out of the batch before the next round. Its `Failed`
        (ABORTED) comes out of the next step; an unknown or finished id is ignored."""
        with self._cond:
            for queued in self._waiting:
                if queued.request_id == request_id:
                    self._waiting.remove(queued)
                    self._pending.append(Failed(request_id, FailReason.ABORTED, "aborted"))
                    self._cond.notify_all()
                    return
            if request_id in self._running or request_id in self._starting:
                self._aborts.add(request_id)
                self._cond.notify_all()

    def close(self) -> None:
        """Refuse new requests (EngineClosed); what is in keeps going until aborted or finished."""
        with self._cond:
            self._closed = True
            self._woken = True
            self._cond.notify_all()

    @property
    def idle(self) -> bool:
        """Nothing queued, running or waiting to be reported."""
        with self._cond:
            return not self._has_work()

    def wait_for_work(self, timeout: float | None = None) -> None:
        """Block until there is something to step, or `wake()`."""
        with self._cond:
            if not self._has_work() and not self._woken:
                self._cond.wait(timeout)
            self._woken = False

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running or self._starting or self._pending)

    def _check_room(self, rows: int) -> None:
        queued_rows = sum(max(1, q.request.rows) for q in self._waiting)
        in_system = queued_rows + self._rows
        if in_system + rows > self.max_batch_size + self.max_queue:
            # roughly when a slot frees up: the batch finishes max_batch_size requests per mean duration
            ahead = max(1, in_system - self.max_batch_size - self.max_queue + 1)
            retry = int(min(60, max(1, math.ceil(self._mean_request_s * ahead / self.max_batch_size))))
            raise QueueFull(retry, running=len(self.batch), waiting=len(self._waiting))

    # ------------------------------------------------------------ the model thread

    def step(self) -> CoreStep:
        """Admit what fits, drop what was aborted or timed out, run one round; what happened, as data."""
        outputs: list[Output] = []
        for queued in self._admit(outputs):
            started = False
            try:
                started = self._start(queued, outputs)
            finally:
                with self._cond:
                    del self._starting[queued.request_id]
                    if not started:
                        self._rows -= queued.request.rows
        self._drop_stopped(outputs)
        if not len(self.batch):
            return CoreStep(outputs, self._stats(0, ran=False))
        try:
            results = self.batch.step()
        except Exception:  # a fault of what the rows share (one row's own faults are in batch.failed): no
            # row's cache can be trusted, so the batch's requests fail; the core goes on with the queue
            log.exception("engine failed during a batched round; failing the batch's requests")
            for request_id in list(self._running):
                self._fail(request_id, FailReason.ENGINE_ERROR, "the engine failed in a round", outputs)
            self.batch.clear()
            return CoreStep(outputs, self._stats(0, ran=False))
        now = time.monotonic()
        round_rows = len(results) + len(self.batch.failed)
        # each batch row's request and choice, read off the running requests (one pass, no index to keep)
        owner = {id(c.generation): (rid, c) for rid, r in self._running.items() for c in r.choices}
        for generation, error in self.batch.failed:  # the batch already took them out
            request_id, _ = owner[id(generation)]
            if request_id in self._running:
                reason = FailReason.INVALID if isinstance(error, DecodingError) else FailReason.ENGINE_ERROR
                self._fail(request_id, reason, str(error), outputs)
        for generation, decoded in results:
            request_id, choice = owner[id(generation)]
            running = self._running.get(request_id)
            if running is None:  # failed in this round through another of its choices
                continue
            self._round_decoded(request_id, running, choice, decoded, now, outputs)
        return CoreStep(outputs, self._stats(round_rows, ran=True))

    def _stats(self, round_rows: int, ran: bool) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.batch), waiting=len(self._waiting), round_rows=round_rows, ran=ran
        )

    def _admit(self, outputs: list[Output]) -> list[_Queued]:
        """Take queued requests while the batch has room (in arrival order, none overtaking)."""
        taken: list[_Queued] = []
        now = time.monotonic()
        with self._cond:
            outputs.extend(self._pending)
            self._pending = []
            taken_rows = 0
            while self._waiting:
                queued = self._waiting[0]
                rows = queued.request.rows
                if queued.deadline is not None and now > queued.deadline:
                    self._waiting.popleft()
                    outputs.append(Failed(queued.request_id, FailReason.TIMEOUT, "timed out in the queue"))
                    continue
                if rows > self.max_batch_size:  # could never fit: answer, never wait
                    self._waiting.popleft()
                    outputs.append(
                        Failed(queued.request_id, FailReason.TOO_MANY_ROWS, "n is above the batch size")
                    )
                    continue
                if rows > self.batch.room() - taken_rows:
                    break
                taken.append(self._waiting.popleft())
                self._starting[queued.request_id] = queued
                self._rows += rows
                taken_rows += rows
        return taken

    def _start(self, queued: _Queued, outputs: list[Output]) -> bool:
        """Score the prompt if asked, start the request's choices in the batch; False when it did not start."""
        request_id, request = queued.request_id, queued.request
        try:
            if request.prompt_logprobs is not None:
                scored = prompt_logprobs(self.engine.target, request.prompt_ids, request.prompt_logprobs)
                outputs.append(PromptScored(request_id, scored))
            if not request.generate:  # max_tokens 0: every choice is the scored prompt alone
                stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
                for index in range(request.n):
                    last = index == request.n - 1
                    outputs.append(Finished(request_id, index, "length", "", stats, None, last, 0))
                return False
            generations = [
                self.engine.generate(
                    request.prompt_ids, request.sampling_for(i), request.spec, request.drafter
                )
                for i in range(request.n)
            ]
            self.batch.add_group(generations)
        except DecodingError as exc:
            outputs.append(Failed(request_id, FailReason.INVALID, str(exc)))
            return False
        except Exception:
            log.exception("engine failed to start a generation")
            outputs.append(Failed(request_id, FailReason.ENGINE_ERROR, "the engine failed to start it"))
            return False
        started = time.monotonic()
        choices = [_Choice(g, i, started) for i, g in enumerate(generations)]
        with self._cond:
            self._running[request_id] = _Running(queued, choices)
        outputs.append(Started(request_id, len(request.prompt_ids)))
        return True

    def _drop_stopped(self, outputs: list[Output]) -> None:
        """Aborted or timed-out requests leave the batch before the next round."""
        now = time.monotonic()
        with self._cond:
            aborts, self._aborts = self._aborts, set()
        for request_id, running in list(self._running.items()):
            if request_id in aborts:
                self._fail(request_id, FailReason.ABORTED, "aborted", outputs)
            elif running.queued.deadline is not None and now > running.queued.deadline:
                self._fail(request_id, FailReason.TIMEOUT, "timed out", outputs)

    def _fail(self, request_id: str, reason: FailReason, message: str, outputs: list[Output]) -> None:
        running = self._forget(request_id)
        for choice in running.choices:
            self.batch.remove(choice.generation)
        outputs.append(Failed(request_id, reason, message, was_running=True))

    def _forget(self, request_id: str) -> _Running:
        with self._cond:
            running = self._running.pop(request_id)
            self._rows -= len(running.choices) - running.finished
        return running

    def _round_decoded(
        self,
        request_id: str,
        running: _Running,
        choice: _Choice,
        decoded: GenerationRound,
        now: float,
        outputs: list[Output],
    ) -> None:
        since_last = None if choice.last_round_end is None else now - choice.last_round_end
        if choice.first_tokens is None:
            choice.first_tokens = now
        choice.last_round_end = now
        timing = ChoiceTiming(choice.started, choice.first_tokens, now)
        generation = choice.generation
        outputs.append(RoundDecoded(request_id, choice.index, decoded, timing, since_last, generation.stats))
        if decoded.finish_reason is None:
            return
        with self._cond:
            running.finished += 1
            self._rows -= 1
        running.max_generation_tokens = max(running.max_generation_tokens, generation.stats.completion_tokens)
        done = running.finished == len(running.choices)
        reason = generation.finish_reason or "stop"
        outputs.append(
            Finished(
                request_id,
                choice.index,
                reason,
                generation.text,
                generation.stats,
                timing,
                done,
                running.max_generation_tokens,
                generation,
            )
        )
        self._mean_request_s = 0.8 * self._mean_request_s + 0.2 * (now - choice.started)
        if done:
            with self._cond:
                del self._running[request_id]


def run_alone(generation: Generation) -> Iterator[GenerationRound]:
    """Decode one generation in a batch of its own; yields one `GenerationRound` per target forward."""
    batch = Batch(generation.target, generation.policy)
    batch.add(generation)
    try:
        while generation.finish_reason is None:
            for decoding, decoded in batch.step():
                if decoding is generation:
                    yield decoded
            for failed, error in batch.failed:
                if failed is generation:
                    raise error
    finally:
        batch.remove(generation)


def run_to_end(
    generation: Generation, on_round: Callable[[GenerationRound], None] | None = None
) -> Generation:
    for decoded in run_alone(generation):
        if on_round is not None:
            on_round(decoded)
    return generation
