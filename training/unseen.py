"""Prompts unlike the training corpus: what a head's confidence is calibrated on, what its card predicts from,
and what `python -m training.evaluate` scores heads on.

The corpus is the target's own writing (training.magpie): it asks itself the questions it finds typical and
answers them predictably, so held-out corpus answers flatter a head (a card predicted 2.20 tokens per forward
from them, the benchmark's prompts gave ~1.6). Prompts people wrote are the honest yardstick. Two families,
both under `bench/data/` so the corpus filter (training.overlap) keeps every training prompt 8-word-disjoint
from them:
- CALIBRATION: `calibration-chat.jsonl` (open chat) and `calibration.jsonl` (grounded tasks: summarise,
  rewrite, answer from a text, edit code, extract; the same file calibrates the benchmark's correction memory).
  A head's confidence temperature is fitted on one half of these prompts and its card predicts from the other
  half, so the prediction is on prompts nothing was fitted on.
- EVALUATION: `chat.jsonl` and `grounded.jsonl`, the benchmark's own prompts: nothing in training reads them;
  `training.evaluate` scores finished heads on them.

Each set is answered greedily by the target in the serving dtype (what vanilla decoding outputs) and its
features computed as for training (training.features), cached by name in a work folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the models load after `python -m training` has read its arguments (`--help` stays fast)
    from service.executor.models import LoadedModel

CALIBRATION_SETS = ("calibration-chat", "calibration")
EVALUATION_SETS = ("chat", "grounded")
# what each set holds, for model cards and reports
KINDS = {
    "calibration-chat": "open chat",
    "calibration": "grounded tasks",
    "chat": "open chat",
    "grounded": "grounded tasks",
}


def answers(target: LoadedModel, name: str, max_tokens: int, limit: int | None = None) -> list[dict]:
    """The target's greedy answers (up to `max_tokens`) to the prompts of `bench/data/<name>.jsonl`."""
    from bench.workloads import DATA_DIR, read_jsonl
    from service.decoding.text import encode_chat
    from training.sampling import decode_batch

    items = read_jsonl(DATA_DIR / f"{name}.jsonl")[:limit]
    stop = target.eos_token_ids()
    records = []
    for first in range(0, len(items), 16):
        chunk = items[first : first + 16]
        prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": i["prompt"]}]) for i in chunk]
        for prompt, (tokens, _) in zip(prompts, decode_batch(target, prompts, max_tokens, stop), strict=True):
            records.append({"prompt_ids": prompt, "answer_ids": tokens})
    return records


def features(
    target: LoadedModel, name: str, work: Path, max_tokens: int = 128, limit: int | None = None
) -> Path:
    """The feature file of set `name` (computed once, then read from `work`)."""
    from training.features import shard_features

    out = work / f"{name}-{max_tokens}-{limit}.safetensors"
    if not out.exists():
        shard_features(target, answers(target, name, max_tokens, limit), out)
    return out
