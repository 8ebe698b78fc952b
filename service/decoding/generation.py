"""One sequence's half of decoding: its draft budget, verification and emission.

A `Generation` is decoded by a `service.decoding.batch.Batch`, which owns the target forward, the caches and
the drafters' batched state, and runs one round for all its sequences at once (the round is read top to
bottom in `Batch._round`). Per round a generation:
- says how many draft tokens it may verify (`draft_budget`: its token budget and context room);
- verifies the round's logits with its method's rule (`verify`): the draft tokens it keeps, then one
  recovered or bonus token;
- emits them (`emit`) through EOS, the token budget and stop strings, and counts the round.

Before the forward, a constrained sequence (structured output) checks its draft against its grammar
(`constrain`: cut at the first forbidden token, tokens the grammar forces drafted for free). Verification
runs on processed logits (`processing.LogitsProcessing`: penalties, logit bias, min_tokens, the grammar's
masks), each row processed with the draft prefix before it, as plain decoding would have processed it.

Invariant between rounds: the target cache holds every committed token except the last, whose logits the
next round's forward computes together with the draft; the grammar matcher and the penalty counts hold
exactly the committed output. Vanilla decoding is the same loop with no draft, so the
baseline and the speculative methods share every line that is not speculation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Sequence

import torch

from service.decoding.draft_policy import DraftPolicy, RowAcceptance
from service.decoding.drafters.base import Draft, Drafter, DraftRow
from service.decoding.fact_guard import fact_refusal, model_special_ids, model_token_classes
from service.decoding.grammar import model_grammar
from service.decoding.prefix_cache import PrefixCache
from service.decoding.processing import LogitsProcessing
from service.decoding.scoring import top_logprobs
from service.decoding.text import IncrementalDetokenizer, StopMatcher
from service.decoding.types import (
    DecodingError,
    EmittedToken,
    GenerationRound,
    GenerationStats,
    Method,
    SamplingParams,
    SpeculativeConfig,
)
from service.decoding.verification import (
    CorrectionMemory,
    RescueGuard,
    RescueRule,
    Verdict,
    calibrated_rule,
    lossy_rule,
    recording_rule,
    turn_guard,
    verify_greedy,
    verify_sampling,
)
from service.executor.models import LoadedModel

# The draft policy's key for drafts the grammar forced (jump-forward): their survival is learnt apart from
# the drafter's own guesses.
FORCED_KEY = -1
IMPOSSIBLE_LOGPROB = -9999.0


def rescue_guards(spec: SpeculativeConfig, target: LoadedModel) -> list[RescueGuard]:
    """The guards a CSD rescue must pass (our choice beyond the paper, /work/shared/CSD.md): the turn guard
    (`spec.guard_turns`) and the context fact guard (`spec.guard_facts`)."""
    guards: list[RescueGuard] = []
    if spec.guard_turns:
        guards.append(turn_guard(model_special_ids(target)))
    if spec.guard_facts:
        guards.append(functools.partial(fact_refusal, model_token_classes(target)))
    return guards


def rescue_rule_for(
    spec: SpeculativeConfig,
    memory: CorrectionMemory | None,
    record_strict: bool = False,
    guards: Sequence[RescueGuard] = (),
    refused: Counter | None = None,
) -> RescueRule | None:
    """The one place a method name becomes a verification rule. `guards`: what a CSD rescue must pass
    (`rescue_guards`); `refused` counts, by reason, the rescues they refused that the gates had passed."""
    if spec.method is Method.CSD:
        if memory is None:
            raise DecodingError("method 'csd' needs an Online Correction Memory")
        return calibrated_rule(memory, spec.lambda_, spec.tau, guards, refused)
    if spec.method is Method.LOSSY:
        return lossy_rule(spec.lossy_threshold)
    if spec.method is Method.SD and record_strict and memory is not None:
        return recording_rule(memory)
    return None


class Generation:
    """One sequence being generated. `run_alone()` (engine.py) decodes it alone (a batch of one) and yields its
    `GenerationRound`s, one per target forward; a server's `Batch` decodes it among others.

    Stopping early (a cancelled request) simply drops the caches: nothing else to undo.
    """

    def __init__(
        self,
        target: LoadedModel,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        spec: SpeculativeConfig,
        drafter: Drafter | None = None,
        memory: CorrectionMemory | None = None,
        record_strict: bool = False,
        policy: DraftPolicy | None = None,
        prefix_cache: PrefixCache | None = None,
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
        guards = rescue_guards(spec, target) if spec.method is Method.CSD else []
        # rescues the guards refused that both gates had passed, by reason ("turn", "fact", "number", ...)
        self.refused_rescues: Counter = Counter()
        self.rescue = rescue_rule_for(spec, memory, record_strict, guards, self.refused_rescues)
        self.generator: torch.Generator | None = None
        if not sampling.greedy:
            self.generator = torch.Generator(device=target.device)
            if sampling.seed is not None:
                self.generator.manual_seed(sampling.seed % 2**64)  # (the API takes any integer)
            else:
                self.generator.seed()
        self.drafter = drafter if spec.speculates else None
        self.policy = policy or DraftPolicy()
        self.acceptance = RowAcceptance()  # this sequence's own draft survival: its say in the draft cap
        # the engine's cache of earlier prompts' KV blocks (None: prefill every prompt in full)
        self.prefix_cache = prefix_cache
        # tokens that end the generation without being part of it: EOS (unless ignored) and stop_token_ids
        self.eos_ids = (set() if sampling.ignore_eos else target.eos_token_ids()) | set(
            sampling.stop_token_ids
        )
        # the one of them that ended it, if one did (vLLM's `stop_reason` for a token): it is not part of
        # `tokens`, and a caller that keeps a turn's own ending (the training corpus) needs to know which
        self.stop_token_id: int | None = None
        # special tokens that do not end the generation (a chat template's turn start): never drafted
        self._unending_specials = model_special_ids(target) - self.eos_ids
        vocab = target.vocab_size
        if any(not 0 <= t < vocab for t, _ in sampling.logit_bias) or any(
            not 0 <= t < vocab for t in sampling.stop_token_ids
        ):
            raise DecodingError(f"token ids must be in [0, {vocab}) for this model")
        self.processing = LogitsProcessing(sampling, self.prompt_ids, self.eos_ids, vocab, target.device)
        self.grammar = model_grammar(target).matcher(sampling.constraint) if sampling.constraint else None
        self._allowed: torch.Tensor | None = None  # this round's grammar masks, from `constrain`
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))
        self.tokens: list[EmittedToken] = []
        self.text = ""
        self.finish_reason: str | None = None
        # the sequence so far (prompt + kept output); the target's cache holds all of it but the last token
        self.committed = list(self.prompt_ids)
        self.detok = IncrementalDetokenizer(target.tokenizer, self.committed)
        self.stops = StopMatcher(sampling.stop)
        self.prefilled = 0  # prompt tokens already in the cache (of the len - 1 that prefill covers)
        # the target's final hidden state at the position that chose committed[-1] ([hidden]), set by the
        # batch after each forward: what a draft head starts from
        self.target_hidden: torch.Tensor | None = None

    # ------------------------------------------------------------------ what the batch asks of a sequence

    @property
    def prefill_ids(self) -> list[int]:
        """What prefill must feed: every prompt token but the last, which the first round feeds with the
        first draft."""
        return self.prompt_ids[:-1]

    def draft_row(self) -> DraftRow | None:
        """This round's request to the drafter, or None when the sequence does not speculate this round."""
        k = self.draft_budget()
        if not k or self.drafter is None:
            return None
        return DraftRow(
            self, self.committed, k, self.sampling, self.generator, self.target_hidden, self.spec.draft_pool
        )

    def draft_budget(self) -> int:
        """The most draft tokens this round may verify: a round emits up to k + 1 tokens, so never draft
        what the token budget or the context could not keep."""
        remaining = self.sampling.max_tokens - len(self.tokens)
        room = self.target.max_context - len(self.committed) - 1
        return max(
            0, min(self.spec.num_speculative_tokens if self.spec.speculates else 0, remaining - 1, room)
        )

    def constrain(self, draft: Draft) -> Draft:
        """Check this round's draft against the grammar (no-op without one): drafts what the grammar forces
        when the drafter disagrees with it, cuts the draft at the first forbidden token and keeps the masks
        of every position for verification."""
        if self.grammar is None:
            return draft
        budget = self.draft_budget() if self.drafter is not None and self.spec.jump_forward else 0
        forced = self.grammar.forced_tokens(budget)
        if forced and draft.tokens[: len(forced)] != forced:
            draft = Draft(forced, None, FORCED_KEY)
        valid, self._allowed = self.grammar.check_draft(draft.tokens)
        return draft.cut(valid)

    def admissible(self, draft: Draft) -> Draft:
        """The draft without the tokens that cannot come next: nothing after a token that ends the generation
        (EOS, a stop token id: emission ends there, so verifying past it is wasted work), and nothing from a
        special token that does not end it on (an n-gram continued a prompt's "<|im_end|>" into
        "<|im_start|>", which the target never writes inside its turn). Only shortens: what a strict method
        emits is the target's choice either way, and CSD's turn guard never rescues a special token."""
        for i, token in enumerate(draft.tokens):
            if token in self.eos_ids:
                return draft.cut(i + 1)
            if token in self._unending_specials:
                return draft.cut(i)
        return draft

    def round_tokens(self, draft: Draft) -> list[int]:
        """What the round's forward feeds for this sequence: [last committed token, *draft]."""
        return [self.committed[-1], *draft.tokens]

    def verify(self, draft: Draft, logits: torch.Tensor) -> Verdict:
        """The method's rule on the round's logits ([1 + len(draft), V], float32, after this sequence's logit
        processing): which draft tokens it keeps (accepted or rescued) and the target's token after them."""
        if self.grammar is not None or self.processing.active:
            logits = self.processing.apply(logits, draft.tokens, len(self.tokens), self._allowed)
        verdict = self._verify(draft.tokens, draft.probs, logits)
        if self.sampling.logprobs is not None:
            verdict.tokens = self._with_logprobs(verdict.tokens, logits)
        return verdict

    def emit(self, draft: Draft, verdict: Verdict, seconds: float) -> GenerationRound:
        """Emit what `verify` kept (EOS, stop strings and the token budget may cut it) and count the round:
        the drafter's acceptance for the draft policy, the statistics of what was emitted."""
        if draft.tokens:
            self.policy.observe(self.drafter.name, draft.key, len(draft.tokens), verdict.round.num_kept)
            self.acceptance.observe(len(draft.tokens), verdict.round.num_kept)
            if draft.key == FORCED_KEY:
                self.stats.forced_tokens += len(draft.tokens)
        decoded = self._emit(verdict)
        self.stats.add_round(decoded.round)
        self.stats.num_rejections_seen += verdict.round.num_recovered  # what verification saw, emitted or not
        self.stats.decode_seconds += seconds
        if self.grammar is not None:
            self.stats.grammar_seconds = self.grammar.seconds
        return decoded

    def _with_logprobs(self, tokens: list[EmittedToken], logits: torch.Tensor) -> list[EmittedToken]:
        """Token j of a round was chosen at row j: its logprob there, after processing and temperature
        (greedy reports the processed distribution at temperature 1), plus the top alternatives."""
        temperature = 1.0 if self.sampling.greedy else self.sampling.temperature
        logprobs = torch.log_softmax(logits[: len(tokens)].float() / temperature, dim=-1)
        # a token the grammar (or a -100 bias) rules out: OpenAI's -9999.0 instead of -inf, which JSON lacks
        logprobs = logprobs.clamp_min(IMPOSSIBLE_LOGPROB)
        top_n = self.sampling.logprobs or 0
        if top_n:
            values, ids = top_logprobs(logprobs, top_n)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        else:
            tops = [[] for _ in tokens]
        index = torch.tensor([[t.token_id] for t in tokens], device=logprobs.device)
        chosen = logprobs.gather(1, index).squeeze(1).tolist()
        return [
            dataclasses.replace(t, logprob=lp, top_logprobs=tuple(top))
            for t, lp, top in zip(tokens, chosen, tops, strict=True)
        ]

    def _verify(self, draft: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor) -> Verdict:
        if self.sampling.greedy:
            return verify_greedy(draft, logits, self.rescue, self.committed)
        return verify_sampling(
            draft,
            draft_probs,
            logits,
            self.sampling.temperature,
            self.sampling.top_p,
            self.generator,
            self.rescue,
            self.committed,
        )

    def _emit(self, verdict: Verdict) -> GenerationRound:
        """Apply EOS, the token budget and stop strings to a round's tokens; extend the sequence."""
        committed, detok, stops = self.committed, self.detok, self.stops
        emitted: list[EmittedToken] = []
        text = ""
        for token in verdict.tokens:
            if token.token_id in self.eos_ids:
                self.finish_reason = "stop"
                self.stop_token_id = token.token_id
                self.stats.num_eos = 1
                break
            emitted.append(token)
            committed.append(token.token_id)
            self.processing.commit([token.token_id])
            piece, stopped = stops.feed(detok.push([token.token_id]))
            text += piece
            if stopped:
                self.finish_reason = "stop"
                break
            if self.grammar is not None:
                self.grammar.commit(token.token_id)
                if self.grammar.stopped:  # complete: only EOS could follow, so end without that forward
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
        # statistics count what was emitted, so they equal the provenance of the tokens (GenerationStats)
        cut = len(emitted) < len(verdict.tokens)
        ended_on_eos = cut and verdict.tokens[len(emitted)].token_id in self.eos_ids
        round_stats = verdict.round.emitted(emitted, cut, ended_on_eos)
        return GenerationRound(emitted, text, round_stats, self.finish_reason)
