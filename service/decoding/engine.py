"""The engine: a target model with the drafters and memories it may use; starts and runs generations.

Where things live: the per-sequence half of a round (draft budget, verification, emission) is
`generation.Generation`; the round itself, for all sequences of a batch (drafting, the draft cap, one target
forward, verification, rollback), is `batch.Batch._round`; drafters are in `drafters/`. Running a generation
alone is a batch of one, so a sequence served alone and one served among others go through the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from service.decoding.batch import Batch
from service.decoding.draft_policy import DraftPolicy
from service.decoding.drafters.base import Drafter
from service.decoding.generation import Generation
from service.decoding.models import LoadedModel
from service.decoding.prefix_cache import PrefixCache, prefix_caching_unsupported
from service.decoding.types import DecodingError, GenerationStep, SamplingParams, SpeculativeConfig
from service.decoding.verification import DivergenceMemory


class Engine:
    """A target model plus the drafters and memory it may use; starts `Generation`s."""

    def __init__(
        self,
        target: LoadedModel,
        drafters: dict[str, Drafter] | None = None,
        memories: dict[str, DivergenceMemory] | None = None,
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


def run_alone(generation: Generation) -> Iterator[GenerationStep]:
    """Decode one generation in a batch of its own; yields one step per target forward."""
    batch = Batch(generation.target, generation.policy)
    batch.add(generation)
    try:
        while generation.finish_reason is None:
            for stepped, step in batch.step():
                if stepped is generation:
                    yield step
            for failed, error in batch.failed:
                if failed is generation:
                    raise error
    finally:
        batch.remove(generation)


def run_to_end(generation: Generation, on_step: Callable[[GenerationStep], None] | None = None) -> Generation:
    for step in run_alone(generation):
        if on_step is not None:
            on_step(step)
    return generation
