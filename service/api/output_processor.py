"""The engine core's outputs as the events a request's handler formats: token texts, bytes, provenance.

Detokenizing lives here, not in the core (which deals in token ids) nor in the formatters (which shape
JSON and SSE chunks from these events): one tokenizer call per round for all the texts it needs.
"""

from __future__ import annotations

from service.api.events import DoneEvent, GenerationPlan, PromptEvent, RoundEvent
from service.decoding.requests import Finished, PromptScored, RoundDecoded
from service.decoding.text import token_bytes


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def prompt(self, plan: GenerationPlan, out: PromptScored) -> PromptEvent:
        ids = set(plan.prompt_ids) | {i for entry in out.logprobs if entry for i, _ in entry[1]}
        return PromptEvent(list(plan.prompt_ids), out.logprobs, self.texts(ids))

    def round(self, plan: GenerationPlan, out: RoundDecoded) -> RoundEvent:
        decoded = out.round
        token_texts = None
        if plan.return_provenance:
            # every token's text and the text of the draft token it replaced, in one tokenizer call each
            texts = self.tokenizer.batch_decode([[t.token_id] for t in decoded.tokens])
            replaced = [t for t in decoded.tokens if t.replaced_token_id is not None]
            replaced_texts = iter(self.tokenizer.batch_decode([[t.replaced_token_id] for t in replaced]))
            token_texts = [
                (text, None if t.replaced_token_id is None else next(replaced_texts))
                for t, text in zip(decoded.tokens, texts, strict=True)
            ]
        logprob_texts = logprob_bytes = None
        if plan.sampling.logprobs is not None:
            ids = {t.token_id for t in decoded.tokens} | {
                i for t in decoded.tokens for i, _ in t.top_logprobs
            }
            logprob_texts = self.texts(ids)
            logprob_bytes = token_bytes(self.tokenizer, sorted(ids))
        return RoundEvent(
            decoded.text,
            len(decoded.tokens),
            decoded.finish_reason,
            list(decoded.tokens),
            token_texts,
            decoded.round.num_draft_tokens,
            index=out.index,
            logprob_texts=logprob_texts,
            logprob_bytes=logprob_bytes,
        )

    @staticmethod
    def done(out: Finished) -> DoneEvent:
        return DoneEvent(out.finish_reason, out.text, out.stats, index=out.index)

    def texts(self, ids: set[int]) -> dict[int, str]:
        """Token id -> its text (one tokenizer call for all)."""
        ordered = sorted(ids)
        return dict(zip(ordered, self.tokenizer.batch_decode([[i] for i in ordered]), strict=True))
