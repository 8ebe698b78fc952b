"""Self-distillation data: the target's own greedy answers to the prompt corpus, with its final hidden states.

For each prompt the target answers greedily (temperature 0, the regime the benchmark and most serving
measure acceptance in). For every position we keep what the draft head is trained on:
- `tokens[i]`: a token the target has just committed (the prompt's last token, then each answer token);
- `hidden[i]`: the target's final hidden state (the input of its LM head) at the position *before*
  `tokens[i]`, i.e. exactly what the serving engine hands the drafter at the start of a round: the hidden
  state whose logits chose the token the round starts from;
- the label of pair i is `tokens[i + 1]`.

Why our own loop and not the service's `Batch`: the hidden states come out of the very forwards that
decode (a hook on the LM head's input), so no second teacher-forced pass is needed: on 2 CPU cores that
halves the time of the pipeline. Static batches of prompts of similar length keep padding small.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from service.decoding.models import LoadedModel
from service.decoding.text import encode_chat

log = logging.getLogger(__name__)


@torch.inference_mode()
def answer_batch(
    target: LoadedModel, prompts: list[list[int]], max_new_tokens: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy answers for prompts of one batch; per prompt (tokens, hidden [len(tokens), d]) as described in
    the module docstring (tokens start with the prompt's last token, the answer ends before EOS)."""
    model, device = target.model, target.device
    capture = target.final_hidden  # the LM head's input on every forward (a hook, installed once)
    eos = target.eos_token_ids()
    rows, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's next token goes in the same column
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        cache=cache,
        logits_to_keep=2,
    )
    assert capture.latest is not None
    hidden = [[capture.latest[b, 0].float().cpu()] for b in range(rows)]  # before the prompt's last token
    tokens = [[p[-1]] for p in prompts]
    previous = capture.latest[:, 1].float().cpu()
    next_ids = out.logits[:, -1].argmax(-1)
    done = [False] * rows
    position = positions[:, -1]
    for _ in range(max_new_tokens):
        for b in range(rows):
            if done[b]:
                continue
            token = int(next_ids[b])
            if token in eos:
                done[b] = True
                continue
            tokens[b].append(token)
            hidden[b].append(previous[b])
        if all(done):
            break
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], dim=1)
        position = position + 1
        out = model(
            input_ids=next_ids[:, None],
            attention_mask=mask.to(device),
            position_ids=position[:, None].to(device),
            cache=cache,
        )
        previous = capture.latest[:, -1].float().cpu()
        next_ids = out.logits[:, -1].argmax(-1)
    return [(t, torch.stack(h)) for t, h in zip(tokens, hidden, strict=True)]


def distill(
    target: LoadedModel,
    items: list[dict],
    out_file: Path,
    *,
    batch_size: int = 24,
    max_new_tokens: int = 160,
    budget_seconds: float | None = None,
) -> list[dict]:
    """Answer `items` (dicts with "prompt") and write tokens, hidden states and row offsets to `out_file`
    (safetensors) and the texts beside it (.jsonl). Stops taking new batches after `budget_seconds`."""
    tokenizer = target.tokenizer
    encoded = [
        (item, encode_chat(tokenizer, [{"role": "user", "content": item["prompt"]}])) for item in items
    ]
    encoded.sort(key=lambda pair: len(pair[1]))  # similar lengths share a batch: little padding
    all_tokens: list[torch.Tensor] = []
    all_hidden: list[torch.Tensor] = []
    offsets = [0]
    records: list[dict] = []
    started = time.perf_counter()
    for first in range(0, len(encoded), batch_size):
        if budget_seconds is not None and time.perf_counter() - started > budget_seconds:
            log.info("time budget spent after %d prompts", len(records))
            break
        chunk = encoded[first : first + batch_size]
        answers = answer_batch(target, [ids for _, ids in chunk], max_new_tokens)
        for (item, _), (tokens, hidden) in zip(chunk, answers, strict=True):
            all_tokens.append(torch.tensor(tokens, dtype=torch.int32))
            all_hidden.append(hidden.to(torch.bfloat16))
            offsets.append(offsets[-1] + len(tokens))
            records.append({**item, "answer": tokenizer.decode(tokens[1:], skip_special_tokens=True)})
        elapsed = time.perf_counter() - started
        log.info(
            "distilled %d/%d prompts, %d positions, %.0f s (%.0f positions/s)",
            len(records),
            len(encoded),
            offsets[-1],
            elapsed,
            offsets[-1] / max(elapsed, 1e-9),
        )
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "tokens": torch.cat(all_tokens),
            "hidden": torch.cat(all_hidden),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
        },
        str(out_file),
    )
    with out_file.with_suffix(".jsonl").open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return records
