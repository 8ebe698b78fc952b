"""Prompt log-probabilities: how likely the target finds each token of a text given the tokens before it.

What loglikelihood evaluation needs (completions' `echo` with `logprobs`, e.g. lm-eval's local-completions
tasks). The raw distribution of the target (temperature 1, no penalties: the prompt was not sampled), as
vLLM's prompt logprobs report it. The prompt goes through in chunks with a cache, so the logits held at
once stay [chunk, V] however long the prompt is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from service.executor.models import LoadedModel

CHUNK = 256


def top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `n` best (values, ids) per row, ties in id order: greedy's argmax takes the lowest id of a tie, so
    the first alternative reported is the token greedy chose. `topk` orders ties arbitrarily, and bf16 logits
    tie often (0.125 apart at magnitude 16-32)."""
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return values[..., :n], ids[..., :n]


def prompt_logprobs(
    target: LoadedModel, ids: Sequence[int], top_n: int
) -> list[tuple[float, tuple[tuple[int, float], ...]] | None]:
    """Per token of `ids`: (its logprob, the `top_n` best (token id, logprob)), None for the first token
    (nothing precedes it)."""
    out: list[tuple[float, tuple[tuple[int, float], ...]] | None] = [None]
    if len(ids) < 2:
        return out
    cache = DynamicCache(config=target.model.config)
    tokens = torch.tensor([list(ids)], dtype=torch.long, device=target.device)
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, CHUNK):
            stop = min(start + CHUNK, len(ids) - 1)
            logits = target.model(input_ids=tokens[:, start:stop], cache=cache).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)  # row j predicts ids[start + j + 1]
            following = tokens[0, start + 1 : stop + 1]
            chosen = logprobs.gather(1, following[:, None]).squeeze(1).tolist()
            if top_n:
                values, top_ids = top_logprobs(logprobs, top_n)
                tops = [
                    tuple(zip(i, v, strict=True))
                    for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)
                ]
            else:
                tops = [() for _ in chosen]
            out.extend(zip(chosen, tops, strict=True))
    return out
