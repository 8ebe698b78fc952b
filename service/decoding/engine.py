"""One sequence's decoding: drafting, verification and emission, around one target forward per round.

Per round (k = num_speculative_tokens, clipped to the token budget, the context and the batch's draft cap):
1. the drafter proposes d_1..d_k after the committed sequence;
2. one target forward over [last committed token, d_1..d_k] extends the target KV cache -> logits [k + 1, V];
3. the method's verification rule keeps a prefix of the draft (accepted / rescued) and adds one target token
   (recovered, or bonus if all k were kept);
4. the cache drops the rejected draft tokens; the drafter catches up on its own next round.

Invariant between rounds: the target cache holds every committed token except the last, whose logits the
next round's forward computes together with the draft. Vanilla decoding is the same loop with k = 0, so the
baseline and the speculative methods share every line that is not speculation.

A `Generation` holds the per-sequence half (steps 1, 3 and stop conditions); the forward and the cache
belong to `service.decoding.batch.Batch`, which runs the round for many sequences at once. Iterating a
`Generation` runs it in a batch of its own, so a sequence served alone and one served among others go
through the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from service.decoding.draft_policy import DraftPolicy
from service.decoding.drafters import Draft, Drafter, DrafterSession
from service.decoding.models import LoadedModel
from service.decoding.text import IncrementalDetokenizer, StopMatcher
from service.decoding.types import (
    DecodingError,
    EmittedToken,
    GenerationStats,
    GenerationStep,
    Method,
    SamplingParams,
    SpeculativeConfig,
)
from service.decoding.verification import (
    DivergenceMemory,
    RescueRule,
    Verdict,
    calibrated_rule,
    lossy_rule,
    recording_rule,
    verify_greedy,
    verify_sampling,
)


def rescue_rule_for(
    spec: SpeculativeConfig, memory: DivergenceMemory | None, record_strict: bool = False
) -> RescueRule | None:
    """The one place a method name becomes a verification rule."""
    if spec.method is Method.CSD:
        if memory is None:
            raise DecodingError("method 'csd' needs an Online Correction Memory")
        return calibrated_rule(memory, spec.lambda_, spec.tau)
    if spec.method is Method.LOSSY:
        return lossy_rule(spec.lossy_threshold)
    if spec.method is Method.SD and record_strict and memory is not None:
        return recording_rule(memory)
    return None


class Generation:
    """One sequence being generated; iterate it for `GenerationStep`s (one per target forward).

    Stopping the iteration early (a cancelled request) simply drops the caches: nothing else to undo.
    """

    def __init__(
        self,
        target: LoadedModel,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        spec: SpeculativeConfig,
        drafter: Drafter | None = None,
        memory: DivergenceMemory | None = None,
        record_strict: bool = False,
        policy: DraftPolicy | None = None,
    ) -> None:
        if not prompt_ids:
            raise DecodingError("prompt must not be empty")
        if len(prompt_ids) >= target.max_context:
            raise DecodingError(
                f"prompt is {len(prompt_ids)} tokens, the model's context is {target.max_context}"
            )
        if spec.speculates and drafter is None:
            raise DecodingError(f"method {spec.method.value!r} needs a drafter")
        self.target = target
        self.prompt_ids = list(prompt_ids)
        self.sampling = sampling
        self.spec = spec
        self.rescue = rescue_rule_for(spec, memory, record_strict)
        self.generator: torch.Generator | None = None
        if not sampling.greedy:
            self.generator = torch.Generator(device=target.device)
            if sampling.seed is not None:
                self.generator.manual_seed(sampling.seed)
            else:
                self.generator.seed()
        self.drafter = drafter
        self.policy = policy or DraftPolicy()
        self.drafter_session: DrafterSession | None = (
            drafter.start(sampling, self.generator) if spec.speculates and drafter is not None else None
        )
        self.eos_ids = set() if sampling.ignore_eos else target.eos_token_ids()
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))
        self.tokens: list[EmittedToken] = []
        self.text = ""
        self.finish_reason: str | None = None
        # the sequence so far (prompt + kept output); the target's cache holds all of it but the last token
        self.committed = list(self.prompt_ids)
        self.detok = IncrementalDetokenizer(target.tokenizer, self.committed)
        self.stops = StopMatcher(sampling.stop)
        self.prefilled = 0  # prompt tokens already in the cache (of the len - 1 that prefill covers)
        self._pending: Draft | None = None  # the cheap drafter's proposal, between planning and verifying

    def __iter__(self) -> Iterator[GenerationStep]:
        """Run this generation alone: a batch of one (the same code path as a batched server)."""
        from service.decoding.batch import Batch  # batch imports this module

        batch = Batch(self.target, self.policy)
        batch.add(self)
        try:
            while self.finish_reason is None:
                for generation, step in batch.step():
                    if generation is self:
                        yield step
                for generation, error in batch.failed:
                    if generation is self:
                        raise error
        finally:
            batch.remove(self)

    # ------------------------------------------------------------------ what the batch asks of a sequence

    @property
    def prefill_ids(self) -> list[int]:
        """What prefill must feed: every prompt token but the last, which the first round feeds with the
        first draft."""
        return self.prompt_ids[:-1]

    def offer_draft(self) -> tuple[str, int, int] | None:
        """Before a round: (drafter, key, available draft length) for the batch's draft-cap decision, or
        None when this sequence does not speculate this round. A cheap drafter proposes now; a draft model
        waits for the cap so that no draft forward is wasted."""
        self._pending = None
        k = self._draft_budget(len(self.committed))
        if not k or self.drafter_session is None:
            return None
        if self.drafter.cheap:
            self._pending = self.drafter_session.propose(self.committed, k)
            if not self._pending.tokens:
                return None
            return self.drafter.name, self._pending.key, min(k, len(self._pending.tokens))
        return self.drafter.name, 0, k

    def draft_limit(self, cap: int) -> int:
        """How many draft tokens this sequence verifies under the batch's cap (its budget may allow fewer)."""
        return max(0, min(cap, self._draft_budget(len(self.committed))))

    def take_draft(self, cap: int) -> Draft:
        """A cheap drafter's proposal cut to the batch's cap (a draft model's drafts come from the batch)."""
        draft, self._pending = self._pending, None
        k = self.draft_limit(cap)
        if k == 0 or draft is None:
            return Draft([])
        probs = draft.probs[:k] if draft.probs is not None else None
        return Draft(draft.tokens[:k], probs, draft.key)

    def round_tokens(self, draft: Draft) -> list[int]:
        """What the round's forward feeds for this sequence: [last committed token, *draft]."""
        return [self.committed[-1], *draft.tokens]

    def absorb(self, draft: Draft, logits: torch.Tensor, seconds: float) -> tuple[GenerationStep, int]:
        """Verify the round's logits ([1 + len(draft), V], float32) and emit. Returns the step and how many
        of the fed tokens the cache keeps (the last committed one plus the kept draft tokens)."""
        verdict = self._verify(draft.tokens, draft.probs, logits)
        if draft.tokens:
            self.policy.observe(self.drafter.name, draft.key, len(draft.tokens), verdict.round.num_kept)
        step = self._emit(verdict)
        self.stats.add_round(verdict.round)
        self.stats.decode_seconds += seconds
        return step, 1 + verdict.round.num_kept

    def _draft_budget(self, committed_len: int) -> int:
        remaining = self.sampling.max_tokens - len(self.tokens)
        room = self.target.max_context - committed_len - 1
        # A round emits up to k + 1 tokens: never draft what the budget could not keep.
        return max(
            0, min(self.spec.num_speculative_tokens if self.spec.speculates else 0, remaining - 1, room)
        )

    def _verify(self, draft: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor) -> Verdict:
        if self.sampling.greedy:
            return verify_greedy(draft, logits, self.rescue)
        return verify_sampling(
            draft,
            draft_probs,
            logits,
            self.sampling.temperature,
            self.sampling.top_p,
            self.generator,
            self.rescue,
        )

    def _emit(self, verdict: Verdict) -> GenerationStep:
        """Apply EOS, the token budget and stop strings to a round's tokens; extend the sequence."""
        committed, detok, stops = self.committed, self.detok, self.stops
        emitted: list[EmittedToken] = []
        text = ""
        for token in verdict.tokens:
            if token.token_id in self.eos_ids:
                self.finish_reason = "stop"
                break
            emitted.append(token)
            committed.append(token.token_id)
            piece, stopped = stops.feed(detok.push([token.token_id]))
            text += piece
            if stopped:
                self.finish_reason = "stop"
                break
            if len(self.tokens) + len(emitted) >= self.sampling.max_tokens:
                self.finish_reason = "length"
                break
            if len(committed) >= self.target.max_context:
                self.finish_reason = "length"
                break
        if self.finish_reason is not None:
            # Held-back text that never became a stop string belongs to the output (after a stop-string
            # match the matcher holds nothing).
            text += stops.flush()
        self.tokens.extend(emitted)
        self.text += text
        self.stats.completion_tokens = len(self.tokens)
        return GenerationStep(emitted, text, verdict.round, self.finish_reason)


class Engine:
    """A target model plus the drafters and memory it may use; starts `Generation`s."""

    def __init__(
        self,
        target: LoadedModel,
        drafters: dict[str, Drafter] | None = None,
        memories: dict[str, DivergenceMemory] | None = None,
        policy: DraftPolicy | None = None,
    ) -> None:
        self.target = target
        self.drafters = drafters or {}
        self.memories = memories or {}  # drafter name -> the memory of the (target, drafter) pair
        # Without measured forward costs the policy verifies every draft in full (fixed speculation).
        self.policy = policy or DraftPolicy()

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
        )


def run_to_end(generation: Generation, on_step: Callable[[GenerationStep], None] | None = None) -> Generation:
    for step in generation:
        if on_step is not None:
            on_step(step)
    return generation
