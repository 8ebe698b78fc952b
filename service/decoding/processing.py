"""Logit processing: penalties, logit bias, min_tokens and grammar masks, per verified position.

A round's forward scores `[last, d_1 .. d_k]`; row i is the distribution after the committed output plus
`d_1 .. d_i`. Plain decoding would have processed row i with exactly that prefix, so every rule here takes
the draft prefix into account (a penalty counts d_1 .. d_i as output already), and verification then runs on
the processed rows: strict speculative decoding stays equal to plain decoding under any processing.

Order (vLLM v1's): grammar mask and min_tokens, logit bias, then the penalties; temperature and top-p come
later, in sampling. Definitions:
- repetition_penalty r (CTRL, vLLM's): over prompt and output tokens, a positive logit is divided by r and a
  negative one multiplied by r;
- frequency_penalty f and presence_penalty p (OpenAI's): over output tokens, z[t] -= f * count(t) +
  p * (count(t) > 0);
- min_tokens: EOS and the stop token ids are masked while fewer tokens were generated (unless the grammar
  allows nothing else: a complete structure must be able to end).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.decoding.types import SamplingParams


class LogitsProcessing:
    """One sequence's processing state: counts of its output tokens and the set of tokens it has seen."""

    def __init__(
        self,
        sampling: SamplingParams,
        prompt_ids: Sequence[int],
        end_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.sampling = sampling
        self.vocab_size = vocab_size
        s = sampling
        self.penalized = s.presence_penalty != 0 or s.frequency_penalty != 0 or s.repetition_penalty != 1
        self.bias: torch.Tensor | None = None
        if s.logit_bias:
            self.bias = torch.zeros(vocab_size, device=device)
            for token, value in s.logit_bias:
                self.bias[token] = value
        # the tokens min_tokens holds back (EOS and the stop token ids)
        self.end_ids = torch.tensor(sorted(set(end_ids)), dtype=torch.long, device=device)
        # only the penalties need the counts (most requests have none: nothing to allocate per request)
        self.output_counts = torch.zeros(vocab_size if self.penalized else 0, device=device)  # per token
        self.seen = torch.zeros(vocab_size if self.penalized else 0, dtype=torch.bool, device=device)
        if prompt_ids and self.penalized:  # the prompt counts for the repetition penalty
            self.seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True

    @property
    def active(self) -> bool:
        """Whether anything but a grammar mask changes the logits."""
        return self.penalized or self.bias is not None or self.sampling.min_tokens > 0

    def commit(self, tokens: Sequence[int]) -> None:
        """Output tokens the sequence kept (only the penalties need them)."""
        if not self.penalized:
            return
        for token in tokens:
            self.output_counts[token] += 1
            self.seen[token] = True

    def apply(
        self,
        logits: torch.Tensor,
        draft: Sequence[int],
        generated: int,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits: [n, V] raw (n <= len(draft) + 1; row i follows draft[:i]); `generated` tokens are already
        out; `allowed`: [>= n, V] grammar masks. Returns new processed logits [n, V]."""
        n = logits.shape[0]
        out = logits.clone()
        if allowed is not None:  # the grammar engine computes its masks on the CPU
            out.masked_fill_(~allowed[:n].to(out.device), float("-inf"))
        min_tokens = self.sampling.min_tokens
        if min_tokens and generated < min_tokens and len(self.end_ids):
            for i in range(min(n, min_tokens - generated)):
                ends = out[i, self.end_ids].clone()
                out[i, self.end_ids] = float("-inf")
                if torch.isinf(out[i]).all():  # only an end was allowed (a finished grammar): let it end
                    out[i, self.end_ids] = ends
        if self.bias is not None:
            out += self.bias
        if self.penalized:
            self._penalize(out, draft)
        return out

    def _penalize(self, out: torch.Tensor, draft: Sequence[int]) -> None:
        n = out.shape[0]
        s = self.sampling
        counts = self.output_counts.expand(n, -1).clone()  # [n, V]: row i counts draft[:i] too
        for i, token in enumerate(draft[: n - 1]):
            counts[i + 1 :, token] += 1
        if s.repetition_penalty != 1:
            seen = self.seen.expand(n, -1) | (counts > 0)
            penalized = torch.where(out > 0, out / s.repetition_penalty, out * s.repetition_penalty)
            out.copy_(torch.where(seen, penalized, out))
        if s.frequency_penalty:
            out -= s.frequency_penalty * counts
        if s.presence_penalty:
            out -= s.presence_penalty * (counts > 0).float()
