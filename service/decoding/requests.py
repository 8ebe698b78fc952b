"""What goes into the engine core and what comes out of it: plain data, no torch, no HTTP.

`EngineCore.add(request_id, EngineRequest)` puts a request in; every `EngineCore.step()` returns a `CoreStep`:
its outputs (a prompt scored, a choice's round of tokens with their provenance, a choice finished with its
reason, a request failed with its reason) and the scheduler's counts. Whoever serves the core (the HTTP
bridge in `service/api/worker.py`, a benchmark, a test) turns these into its own answers; the core never
knows about status codes, texts for clients or metrics.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.decoding.types import GenerationRound, GenerationStats, SamplingParams, SpeculativeConfig

if TYPE_CHECKING:
    from service.decoding.generation import Generation


@dataclass(frozen=True)
class EngineRequest:
    """One prompt and how to decode it: `n` choices share one prefill, then take a batch row each."""

    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpeculativeConfig
    drafter: str  # the engine's drafter name ("ngram", "head", "combined", ...)
    n: int = 1
    # score the prompt too (completions' echo with logprobs), with this many top alternatives per token
    prompt_logprobs: int | None = None
    generate: bool = True  # False: score the prompt only (max_tokens 0)

    @property
    def rows(self) -> int:
        """Batch rows the request occupies."""
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


class FailReason(enum.Enum):
    """Why the core gave up on a request; the API layer maps each to one error (service/api/errors.py)."""

    INVALID = "invalid"  # the request cannot be decoded as asked (a DecodingError: its message says why)
    TOO_MANY_ROWS = "too_many_rows"  # more choices than the batch has rows: it could never start
    ENGINE_ERROR = "engine_error"  # a fault inside the engine; the others in the batch carry on
    TIMEOUT = "timeout"  # its deadline passed before it finished
    ABORTED = "aborted"  # abort() took it out (client gone, shutdown, failed elsewhere)


class QueueFull(Exception):
    """`add` refused a request: the batch and the queue are full. `retry_after_s`: when a slot may free."""

    def __init__(self, retry_after_s: int, running: int, waiting: int) -> None:
        super().__init__("queue full")
        self.retry_after_s = retry_after_s
        self.running = running
        self.waiting = waiting


class EngineClosed(Exception):
    """`add` after `close()`: the engine is shutting down."""


@dataclass(frozen=True)
class ChoiceTiming:
    """time.monotonic() marks of one choice: entered the batch, first tokens out (prefill done), now."""

    started: float
    first_tokens: float | None
    now: float


@dataclass(frozen=True)
class PromptScored:
    """The prompt's own logprobs, before any round: per prompt token (logprob, top alternatives), None for
    the first."""

    request_id: str
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None]


@dataclass(frozen=True)
class Started:
    """The request's choices entered the batch."""

    request_id: str
    prompt_tokens: int


@dataclass(frozen=True)
class RoundDecoded:
    """One choice's share of a round: its tokens (with provenance) and whether it finished."""

    request_id: str
    index: int
    round: GenerationRound
    timing: ChoiceTiming
    since_last: float | None  # seconds since this choice's previous round ended (None: its first)
    stats: GenerationStats  # the choice's running totals (prompt and cached tokens after the first round)


@dataclass(frozen=True)
class Finished:
    """One choice finished (stop, length); `request_done` once all the request's choices have."""

    request_id: str
    index: int
    finish_reason: str
    text: str
    stats: GenerationStats
    timing: ChoiceTiming | None  # None: nothing was generated (a prompt scored only)
    request_done: bool
    max_generation_tokens: int  # the longest of the request's finished choices so far
    generation: Generation | None = None  # its token ids and drafter, for whoever records traffic


@dataclass(frozen=True)
class Failed:
    """The request is out of the core; `message` says why, for the client."""

    request_id: str
    reason: FailReason
    message: str
    was_running: bool = False  # it had entered the batch (metrics count it as finished with an error)


Output = PromptScored | Started | RoundDecoded | Finished | Failed


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state after a step, for a stats sink (vLLM's SchedulerStats)."""

    running: int  # batch rows decoding
    waiting: int  # requests queued
    round_rows: int  # rows the step's round decoded (0: none, or only a prefill chunk)
    ran: bool  # a target forward ran and succeeded (prefill or round): the engine is healthy


@dataclass(frozen=True)
class CoreStep:
    outputs: list[Output]
    stats: SchedulerStats
