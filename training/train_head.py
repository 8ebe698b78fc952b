"""Train the recurrent draft head (service/decoding/draft_head.py) on self-distillation data.

Each example starts at a position i of a target answer with the target's hidden state hidden[i] and unrolls
`unroll` draft steps exactly as serving does: step j consumes tokens[i + j - 1] and must predict
tokens[i + j] (the target's greedy choice). Two losses per step, as in EAGLE (Li et al., 2024):
- cross-entropy on the draft vocabulary against the target's token (what acceptance counts);
- smooth-L1 between the head's state and the target's own hidden state at that position, hidden[i + j]:
  a dense signal that keeps the unrolled state in the space the target's LM head reads.
Steps are teacher-forced on the target's tokens (those are what a kept draft feeds next).

Held-out answers (a seeded 3 %) give the per-step accuracy and the expected tokens per target forward of a
6-token draft, 1 + sum_j prod_{m<=j} acc_m, reported in the model card.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from service.decoding.draft_head import DraftHeadConfig, RecurrentDraftHead
from service.decoding.models import LoadedModel, vocabulary_hash

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    seed: int = 0
    epochs: float = 2.0
    batch_size: int = 512  # start positions per step
    unroll: int = 5  # draft steps trained per example
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    inner_size: int = 1536
    num_blocks: int = 2
    draft_vocab: int = 8192
    state_loss_weight: float = 0.5
    holdout_share: float = 0.03
    eval_positions: int = 8192
    bf16: bool = True  # autocast on CPUs with bf16 matmuls (AVX512-BF16 / AMX) and on GPUs
    # fine-tuning (training/traffic.py): start from this head's weights and keep its draft vocabulary
    # (inner_size, num_blocks and draft_vocab then come from the head); pair it with fewer steps, a lower lr
    init_from: Path | None = None


@dataclass
class Data:
    tokens: torch.Tensor  # [N] int64
    hidden: torch.Tensor  # [N, d] bf16
    ends: torch.Tensor  # [N] the end (exclusive) of the answer each position belongs to


def load_data(files: list[Path]) -> tuple[Data, list[tuple[int, int]]]:
    tokens, hidden, spans = [], [], []
    base = 0
    for file in files:
        data = load_file(str(file))
        offsets = data["offsets"].tolist()
        tokens.append(data["tokens"].long())
        hidden.append(data["hidden"])
        spans += [(base + a, base + b) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        base += offsets[-1]
    all_tokens = torch.cat(tokens)
    ends = torch.empty_like(all_tokens)
    for a, b in spans:
        ends[a:b] = b
    return Data(all_tokens, torch.cat(hidden), ends), spans


def rank_vocabulary(
    tokens: torch.Tensor, spans: list[tuple[int, int]], size: int
) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens (labels), and the share of answer tokens they cover."""
    labels = torch.cat([tokens[a + 1 : b] for a, b in spans])
    counts = torch.bincount(labels)
    size = min(size, int((counts > 0).sum()))
    top = counts.argsort(descending=True)[:size]
    return top.sort().values, float(counts[top].sum()) / max(1, len(labels))


def vocabulary_coverage(tokens: torch.Tensor, spans: list[tuple[int, int]], vocab: torch.Tensor) -> float:
    """The share of answer tokens (labels) that `vocab` holds."""
    labels = torch.cat([tokens[a + 1 : b] for a, b in spans])
    return float(torch.isin(labels, vocab).float().mean()) if len(labels) else 0.0


def _positions(spans: list[tuple[int, int]]) -> torch.Tensor:
    """Start positions with at least one label after them."""
    return torch.cat([torch.arange(a, b - 1) for a, b in spans if b - a >= 2])


def _unrolled_loss(
    head: RecurrentDraftHead, data: Data, starts: torch.Tensor, remap: torch.Tensor, config: TrainConfig
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Mean loss over the unrolled steps, and per step (correct, counted) top-1 tallies."""
    state = data.hidden[starts].float()
    total = state.new_zeros(())
    tallies = []
    for j in range(1, config.unroll + 1):
        pos = starts + j  # the label of step j is tokens[start + j]
        valid = pos < data.ends[starts]
        if not bool(valid.any()):
            break
        safe = torch.where(valid, pos, starts)
        state, logits = head.step(state, data.tokens[safe - 1])
        labels = remap[data.tokens[safe]]
        labels = torch.where(valid, labels, torch.full_like(labels, -100))
        ce = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100)
        target_state = data.hidden[safe].float()
        reg = torch.nn.functional.smooth_l1_loss(state.float()[valid], target_state[valid])
        total = total + ce + config.state_loss_weight * reg
        hit = (logits.argmax(-1) == labels) & valid
        tallies.append((int(hit.sum()), int(valid.sum())))
    return total / config.unroll, tallies


def evaluate(
    head: RecurrentDraftHead, data: Data, starts: torch.Tensor, remap: torch.Tensor, config: TrainConfig
) -> dict:
    """Teacher-forced held-out accuracy per draft step, and the conditional acceptance it implies."""
    head.eval()
    correct = [0] * 6
    counted = [0] * 6
    # conditional: a step counts only where every earlier step was right (what a draft chain needs)
    chain_hits = [0] * 6
    chain_tries = [0] * 6
    with torch.no_grad():
        for first in range(0, len(starts), 2048):
            batch = starts[first : first + 2048]
            state = data.hidden[batch].float()
            alive = torch.ones(len(batch), dtype=torch.bool)
            for j in range(1, 7):
                pos = batch + j
                valid = pos < data.ends[batch]
                safe = torch.where(valid, pos, batch)
                state, logits = head.step(state, data.tokens[safe - 1])
                hit = (head.draft_vocab[logits.argmax(-1)] == data.tokens[safe]) & valid
                correct[j - 1] += int(hit.sum())
                counted[j - 1] += int(valid.sum())
                tries = alive & valid
                chain_tries[j - 1] += int(tries.sum())
                chain_hits[j - 1] += int((hit & tries).sum())
                alive = alive & hit
    head.train()
    accuracy = [c / max(1, n) for c, n in zip(correct, counted, strict=True)]
    conditional = [c / max(1, n) for c, n in zip(chain_hits, chain_tries, strict=True)]
    expected, survive = 1.0, 1.0
    for rate in conditional:
        survive *= rate
        expected += survive
    return {
        "accuracy_per_step": [round(a, 4) for a in accuracy],
        "conditional_acceptance_per_step": [round(a, 4) for a in conditional],
        "expected_tokens_per_forward_k6": round(expected, 3),
        "positions": int(len(starts)),
    }


def train(target: LoadedModel, files: list[Path], out: Path, config: TrainConfig) -> dict:
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    data, spans = load_data(files)
    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(spans), generator=generator).tolist()
    held = max(1, int(len(spans) * config.holdout_share))
    eval_spans = [spans[i] for i in order[:held]]
    train_spans = [spans[i] for i in order[held:]]
    draft_vocab, coverage = rank_vocabulary(data.tokens, train_spans, config.draft_vocab)
    start = RecurrentDraftHead.load(config.init_from) if config.init_from is not None else None
    if start is not None:
        draft_vocab, coverage = (
            start.draft_vocab,
            vocabulary_coverage(data.tokens, train_spans, start.draft_vocab),
        )
    remap = torch.full((max(int(data.tokens.max()), int(draft_vocab.max())) + 1,), -100, dtype=torch.long)
    remap[draft_vocab] = torch.arange(len(draft_vocab))
    log.info(
        "%d answers (%d held out), %d positions; draft vocabulary %d covers %.1f %% of answer tokens",
        len(spans),
        held,
        len(data.tokens),
        len(draft_vocab),
        100 * coverage,
    )
    model = target.model
    embed = model.get_input_embeddings().weight.detach().float()
    lm_head = model.get_output_embeddings().weight.detach().float()
    head_config = DraftHeadConfig(
        hidden_size=embed.shape[1],
        inner_size=config.inner_size,
        num_blocks=config.num_blocks,
        draft_vocab_size=len(draft_vocab),
        target_vocab_hash=vocabulary_hash(target.tokenizer),
        target_name=target.name,
        rms_norm_eps=float(getattr(model.config, "rms_norm_eps", 1e-5)),
    )
    if start is not None:
        head_config = start.config
    head = (start or RecurrentDraftHead(head_config, draft_vocab)).float().bind(embed, lm_head)
    head.train()
    train_starts = _positions(train_spans)
    eval_starts = _positions(eval_spans)
    eval_starts = eval_starts[torch.randperm(len(eval_starts), generator=generator)[: config.eval_positions]]
    steps = max(1, int(config.epochs * len(train_starts) / config.batch_size))
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, steps - config.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    device_type = "cuda" if embed.is_cuda else "cpu"
    history = []
    log.info(
        "training %d steps of %d start positions x %d unrolled steps", steps, config.batch_size, config.unroll
    )
    running, window, tallies_sum = 0.0, 0, None
    for step in range(steps):
        pick = torch.randint(0, len(train_starts), (config.batch_size,), generator=generator)
        starts = train_starts[pick]
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=config.bf16):
            loss, tallies = _unrolled_loss(head, data, starts, remap, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        running += float(loss.detach())
        window += 1
        if tallies_sum is None:
            tallies_sum = [[0, 0] for _ in tallies]
        for t, (c, n) in zip(tallies_sum, tallies, strict=False):
            t[0] += c
            t[1] += n
        if (step + 1) % 50 == 0 or step + 1 == steps:
            acc = [round(c / max(1, n), 3) for c, n in tallies_sum]
            entry = {
                "step": step + 1,
                "loss": round(running / window, 4),
                "train_accuracy_per_step": acc,
                "seconds": round(time.perf_counter() - started, 1),
            }
            history.append(entry)
            log.info("%s", entry)
            running, window, tallies_sum = 0.0, 0, None
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=False):
        held_out = evaluate(head, data, eval_starts, remap, config)
    log.info("held out: %s", held_out)
    report = {
        "config": {**asdict(config), "init_from": str(config.init_from) if config.init_from else None},
        "data": {
            "files": [str(f) for f in files],
            "answers": len(spans),
            "held_out_answers": held,
            "positions": int(len(data.tokens)),
            "draft_vocabulary_coverage": round(coverage, 4),
        },
        "steps": steps,
        "final_loss": history[-1]["loss"] if history else None,
        "held_out": held_out,
        "history": history,
        "seconds": round(time.perf_counter() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    head.save(out, extra={"training": "python -m training (see training.json)"})
    (out / "training.json").write_text(json.dumps(report, indent=1))
    (out / "README.md").write_text(model_card(report, head_config))
    return report


def model_card(report: dict, config: DraftHeadConfig) -> str:
    held = report["held_out"]
    params_m = (
        (2 * config.hidden_size * config.inner_size + config.inner_size * config.hidden_size)
        + (config.num_blocks - 1) * 2 * config.hidden_size * config.inner_size
    ) / 1e6
    return f"""# Recurrent draft head for {config.target_name}

A drafter for speculative decoding with SmolLM2-135M-Instruct (the csd-serve embedded model). Architecture:
`service/decoding/draft_head.py` (a recurrent head on the target's final hidden state, ReDrafter-style,
with a frequency-ranked draft vocabulary). About {params_m:.1f} M parameters of its own; the token embeddings
and LM-head rows are the target's and are not stored here.

- Data: self-distillation. {report["data"]["answers"]} greedy answers of the target ({report["data"]["positions"]}
  positions) to prompts assembled for this project from templates and topic lists (`training/prompts.py`,
  Apache-2.0, no third-party data; disjoint from every `bench/` prompt by an 8-word-overlap filter), plus
  grounded prompts whose passages are the target's own earlier answers.
- Draft vocabulary: {config.draft_vocab_size} tokens, covering {100 * report["data"]["draft_vocabulary_coverage"]:.1f} % of answer tokens.
- Training: {report["steps"]} steps of {report["config"]["batch_size"]} start positions x {report["config"]["unroll"]}
  unrolled draft steps, AdamW lr {report["config"]["lr"]}, seed {report["config"]["seed"]},
  {report["seconds"]:.0f} s on {report["torch_threads"]} CPU threads; final training loss {report["final_loss"]}.
- Held-out (teacher-forced, {held["positions"]} positions): accuracy per draft step {held["accuracy_per_step"]};
  conditional acceptance {held["conditional_acceptance_per_step"]};
  expected tokens per target forward with 6 draft tokens {held["expected_tokens_per_forward_k6"]}.
- Reproduce: `python -m training` (README, "The trained drafter"). Serving figures: README and bench/figures.
- Licence: Apache-2.0 (the target model, SmolLM2, is Apache-2.0).
"""
