"""What a request is to the engine bridge and what comes back to it: the plan, the `Job` a handler waits on,
and the events it yields.

`GenerationPlan` is the engine core's `EngineRequest` plus what only the API needs (provenance texts, the
echo, a probe's exemption from metrics); the events are the output processor's
(`service/api/output_processor.py`) rendering of the core's outputs: texts, token bytes, provenance.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

from service.api.errors import APIError, timed_out
from service.decoding.requests import EngineRequest
from service.decoding.types import EmittedToken, GenerationStats


@dataclass(frozen=True)
class GenerationPlan(EngineRequest):
    """A request turned into what the engine needs; validated before it reaches the queue."""

    return_provenance: bool = False
    internal: bool = False  # a readiness probe: proves the engine works, counts in no metric
    echo_text: str | None = None  # completions' echo: the prompt as text


@dataclass
class RoundEvent:
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
    """The prompt's own logprobs (echo with logprobs), before any round: per prompt token (logprob, top
    alternatives), None for the first."""

    tokens: list[int]
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None]
    texts: dict[int, str]


@dataclass
class ErrorEvent:
    error: APIError


Event = RoundEvent | DoneEvent | ErrorEvent | PromptEvent


class Job:
    """One submitted request. Events arrive on `events` (an asyncio queue of the submitting loop)."""

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
        self.request_id = ""  # the engine core's id, given by submit
        self._cancelled = threading.Event()
        self.cancel_reason = ""

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self, reason: str) -> bool:
        """Mark it cancelled; False when it already was."""
        if self._cancelled.is_set():
            return False
        self.cancel_reason = reason
        self._cancelled.set()
        return True

    def deliver(self, event: Event) -> None:
        # RuntimeError: the loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next_event(self) -> Event:
        """The next event; raises APIError(504) at the deadline."""
        remaining = self.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(self.events.get(), timeout=max(remaining, 0.001))
        except asyncio.TimeoutError:
            raise timed_out() from None
