"""Batched decoding for building training data: greedy answers and sampled user turns.

One loop for both (left padding, one KV cache for the whole batch, each row stops at its own stop token):
answers are the target's greedy choices (the regime acceptance is measured in), user turns are sampled at
temperature ~1 so the corpus is varied (Magpie, arXiv 2406.08464). No hidden states are kept here: the corpus
stores token ids only, and `training.features` recomputes the states with teacher-forced forwards.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from service.executor.models import LoadedModel


@torch.inference_mode()
def decode_batch(
    target: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[tuple[list[int], bool]]:
    """Per prompt: (new tokens, ended with a stop token). The stop token is included in the tokens."""
    model, device = target.model, target.device
    rows, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's next token goes in the same column
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        cache=cache,
        logits_to_keep=1,
    ).logits[:, -1]
    out: list[list[int]] = [[] for _ in range(rows)]
    stopped = [False] * rows
    live = list(range(rows))  # batch row -> prompt index; finished rows leave the batch (their cache too)
    position = positions[:, -1]
    for _ in range(max_new_tokens):
        next_ids = _choose(logits.float(), temperature, top_p, generator).cpu()
        keep = []
        for b, index in enumerate(live):
            token = int(next_ids[b])
            out[index].append(token)
            if token in stop_ids:
                stopped[index] = True
            else:
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(live):  # a batch runs as long as its longest row: don't pay for finished ones
            select = torch.tensor(keep)
            cache.batch_select_indices(select.to(device))
            mask, position, next_ids = mask[select], position[select], next_ids[select]
            live = [live[b] for b in keep]
        mask = torch.cat([mask, torch.ones((len(live), 1), dtype=torch.long)], dim=1)
        position = position + 1
        logits = model(
            input_ids=next_ids[:, None].to(device),
            attention_mask=mask.to(device),
            position_ids=position[:, None].to(device),
            cache=cache,
        ).logits[:, -1]
    return list(zip(out, stopped, strict=True))


def _choose(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: argmax at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest set reaching top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
