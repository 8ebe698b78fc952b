"""Train the recurrent draft head (service/decoding/draft_head.py) on self-distillation data.

Each example starts at a position i of a target answer with the target's hidden state hidden[i] and unrolls
`unroll` drafted positions exactly as serving does: position j consumes tokens[i + j - 1] and must predict
tokens[i + j] (the target's greedy choice). Two losses per position, as in EAGLE (Li et al., 2024):
- cross-entropy on the draft vocabulary against the target's token (what acceptance counts);
- smooth-L1 between the head's state and the target's own hidden state at that position, hidden[i + j]:
  a dense signal that keeps the unrolled state in the space the target's LM head reads.
Positions are teacher-forced on the target's tokens (those are what a kept draft feeds next).

Held-out answers (a seeded 3 %) give the per-position accuracy and the expected tokens per target forward of a
6-token draft, 1 + sum_j prod_{m<=j} acc_m, reported in the model card.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from service.decoding.draft_head import DraftHeadConfig, RecurrentDraftHead
from service.executor.models import LoadedModel, vocabulary_hash
from training.features import feature_layers

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    seed: int = 0
    epochs: float = 2.0
    batch_size: int = 512  # start positions per optimizer step
    unroll: int = 5  # drafted positions trained per example
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
    # EAGLE-3's low + mid + final features (training.features) instead of the final state only
    fuse_layers: bool = False
    # start from this head's weights and draft vocabulary (a fine-tune: new data, or fusion added to a trained
    # head, whose fusion layer then starts at zero, i.e. exactly the old head)
    init_from: Path | None = None
    # with init_from: add the N most frequent answer tokens of this data to the start head's draft vocabulary
    # (the head's own weights do not depend on the vocabulary: only the target's LM-head rows it projects on)
    extend_vocab: int = 0


@dataclass
class Data:
    tokens: torch.Tensor  # [N] int64
    hidden: torch.Tensor  # [N, d] bf16: the final hidden state (what the head's state is pulled towards)
    ends: torch.Tensor  # [N] the end (exclusive) of the answer each position belongs to
    features: torch.Tensor | None = None  # [N, 3d] bf16: low, mid, final (a fused head's input), or None

    def start_features(self, starts: torch.Tensor) -> torch.Tensor:
        """What a round starting at `starts` hands the head (see RecurrentDraftHead.initial_state)."""
        source = self.features if self.features is not None else self.hidden
        return source[starts].float()


def load_data(files: list[Path], fused: bool = False) -> tuple[Data, list[tuple[int, int]]]:
    tokens, hidden, features, spans = [], [], [], []
    base = 0
    for file in files:
        data = load_file(str(file))
        offsets = data["offsets"].tolist()
        tokens.append(data["tokens"].long())
        hidden.append(data["hidden"])
        if fused:
            features.append(torch.cat([data["hidden_low"], data["hidden_mid"], data["hidden"]], dim=-1))
        spans += [(base + a, base + b) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        base += offsets[-1]
        del data
    all_tokens = torch.cat(tokens)
    ends = torch.empty_like(all_tokens)
    for a, b in spans:
        ends[a:b] = b
    return Data(all_tokens, torch.cat(hidden), ends, torch.cat(features) if fused else None), spans


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


def _spans_per_file(spans: list[tuple[int, int]], files: list[Path]) -> list[list[tuple[int, int]]]:
    """`load_data`'s spans of several files, split back into one list per file (in prompt order)."""
    from safetensors import safe_open

    out, first = [], 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            count = f.get_slice("offsets").get_shape()[0] - 1
        out.append(spans[first : first + count])
        first += count
    return out


def _positions(spans: list[tuple[int, int]]) -> torch.Tensor:
    """Start positions with at least one label after them."""
    return torch.cat(
        [torch.arange(a, b - 1) for a, b in spans if b - a >= 2] or [torch.zeros(0, dtype=torch.long)]
    )


def _unrolled_loss(
    head: RecurrentDraftHead, data: Data, starts: torch.Tensor, remap: torch.Tensor, config: TrainConfig
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Mean loss over the unrolled positions, and per position (correct, counted) top-1 tallies."""
    state = head.initial_state(data.start_features(starts))
    total = state.new_zeros(())
    tallies = []
    for j in range(1, config.unroll + 1):
        pos = starts + j  # the label of position j is tokens[start + j]
        valid = pos < data.ends[starts]
        if not bool(valid.any()):
            break
        safe = torch.where(valid, pos, starts)
        state, logits = head.advance(state, data.tokens[safe - 1])
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
    head: RecurrentDraftHead,
    data: Data,
    starts: torch.Tensor,
    remap: torch.Tensor,
    config: TrainConfig,
    max_positions: int = 6,
    min_survival: float | None = None,
) -> dict:
    """Teacher-forced held-out figures of a head:
    - accuracy per drafted position, and the conditional acceptance of a chain (a position counts only where
      every earlier position was right: what a draft needs), with the tokens per forward a full 6-token draft
      implies;
    - `served_tokens_per_forward`: serving simulated, with the head's own stop rule (`MIN_SURVIVAL` on its
      calibrated confidence): each start drafts until the rule stops it or 6 tokens, keeps the draft's
      correct prefix, plus the target's own token. This is the model card's prediction for greedy serving
      with `--drafter head` (the draft policy can only cut drafts shorter). `min_survival`: the stop rule's
      threshold (default: the drafter's `MIN_SURVIVAL`)."""
    from service.decoding.drafters.head import MIN_SURVIVAL

    threshold = MIN_SURVIVAL if min_survival is None else min_survival
    head.eval()
    correct, counted = [0] * max_positions, [0] * max_positions
    chain_hits, chain_tries = [0] * max_positions, [0] * max_positions
    served_kept = served_drafted = 0
    temperature = head.config.confidence_temperature
    with torch.no_grad():
        for first in range(0, len(starts), 2048):
            batch = starts[first : first + 2048]
            state = head.initial_state(data.start_features(batch))
            alive = torch.ones(len(batch), dtype=torch.bool)
            drafting = torch.ones(len(batch), dtype=torch.bool)  # the stop rule has not stopped this row
            survival = torch.ones(len(batch))
            for j in range(1, max_positions + 1):
                pos = batch + j
                valid = pos < data.ends[batch]
                safe = torch.where(valid, pos, batch)
                state, logits = head.advance(state, data.tokens[safe - 1])
                hit = (head.draft_vocab[logits.argmax(-1)] == data.tokens[safe]) & valid
                correct[j - 1] += int(hit.sum())
                counted[j - 1] += int(valid.sum())
                tries = alive & valid
                chain_tries[j - 1] += int(tries.sum())
                chain_hits[j - 1] += int((hit & tries).sum())
                drafting &= valid
                served_drafted += int(drafting.sum())
                served_kept += int((drafting & alive & hit).sum())
                alive = alive & hit
                survival = survival * torch.softmax(logits.float() / temperature, -1).max(-1).values
                drafting &= survival >= threshold
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
        "served_tokens_per_forward": round(1 + served_kept / max(1, len(starts)), 3),
        "served_acceptance": round(served_kept / max(1, served_drafted), 4),
        "served_draft_length": round(served_drafted / max(1, len(starts)), 3),
        "positions": int(len(starts)),
    }


def fit_confidence_temperature(
    head: RecurrentDraftHead, data: Data, starts: torch.Tensor, max_positions: int = 6
) -> dict:
    """Temperature scaling (Guo et al., 2017) of the head's top-1 confidence on held-out answers: the T that
    makes softmax(logits / T).max() the best-calibrated probability that the draft token is the target's
    (binary cross-entropy over every unrolled position). Returns T and the expected calibration error before
    and after, for the model card."""
    grid = [0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.4, 2.8, 3.4, 4.0]
    losses = [0.0] * len(grid)
    confidences: list[list[torch.Tensor]] = [[] for _ in grid]
    hits: list[torch.Tensor] = []
    head.eval()
    with torch.no_grad():
        for first in range(0, len(starts), 2048):
            batch = starts[first : first + 2048]
            state = head.initial_state(data.start_features(batch))
            for j in range(1, max_positions + 1):
                pos = batch + j
                valid = pos < data.ends[batch]
                safe = torch.where(valid, pos, batch)
                state, logits = head.advance(state, data.tokens[safe - 1])
                hit = (head.draft_vocab[logits.argmax(-1)] == data.tokens[safe])[valid].float()
                hits.append(hit)
                for g, t in enumerate(grid):
                    conf = torch.softmax(logits[valid].float() / t, -1).max(-1).values.clamp(1e-6, 1 - 1e-6)
                    confidences[g].append(conf)
                    losses[g] += float(torch.nn.functional.binary_cross_entropy(conf, hit, reduction="sum"))
    head.train()
    best = min(range(len(grid)), key=losses.__getitem__)
    all_hits = torch.cat(hits)

    def ece(conf: torch.Tensor) -> float:
        bins = (conf * 10).clamp(max=9.999).long()
        total = 0.0
        for b in range(10):
            inside = bins == b
            if inside.any():
                total += float(inside.sum()) * abs(
                    float(conf[inside].mean()) - float(all_hits[inside].mean())
                )
        return total / max(1, len(conf))

    return {
        "temperature": grid[best],
        "ece_before": round(ece(torch.cat(confidences[grid.index(1.0)])), 4),
        "ece_after": round(ece(torch.cat(confidences[best])), 4),
        "positions": int(len(starts)),
    }


def train(
    target: LoadedModel,
    files: list[Path],
    out: Path,
    config: TrainConfig,
    unseen: dict[str, Path] | None = None,
) -> dict:
    """Train a head on the feature `files` and write it, its training.json and model card to `out`.

    `unseen`: feature files of prompts unlike the corpus, by name (training.unseen.CALIBRATION_SETS). Given,
    the confidence temperature is fitted on their even-numbered answers and the card predicts serving from
    their odd-numbered ones, per set; without them both come from held-out corpus answers, which flatter."""
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    start = RecurrentDraftHead.load(config.init_from) if config.init_from else None
    if start is not None and start.config.feature_layers:  # a fused head stays fused (traffic fine-tunes)
        config = dataclasses.replace(config, fuse_layers=True)
    data, spans = load_data(files, fused=config.fuse_layers)
    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(spans), generator=generator).tolist()
    held = max(1, int(len(spans) * config.holdout_share))
    # held-out answers: what the card reports on the corpus; without unseen prompts one half of them
    # calibrates the head's confidence instead
    split = held if unseen else (held + 1) // 2
    eval_spans = [spans[i] for i in order[:split]]
    calibration_spans = [spans[i] for i in order[split:held]] or eval_spans
    train_spans = [spans[i] for i in order[held:]]
    if start is not None:
        draft_vocab = start.draft_vocab
        if config.extend_vocab:
            frequent, _ = rank_vocabulary(data.tokens, train_spans, config.extend_vocab)
            draft_vocab = torch.unique(torch.cat([draft_vocab, frequent]))  # sorted, like a ranked one
        coverage = vocabulary_coverage(data.tokens, train_spans, draft_vocab)
    else:
        draft_vocab, coverage = rank_vocabulary(data.tokens, train_spans, config.draft_vocab)
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
        feature_layers=feature_layers(model.config.num_hidden_layers) if config.fuse_layers else (),
    )
    if start is not None:
        head_config = dataclasses.replace(
            head_config, inner_size=start.config.inner_size, num_blocks=start.config.num_blocks
        )
    head = RecurrentDraftHead(head_config, draft_vocab)
    if start is not None:
        weights = {k: v for k, v in start.state_dict().items() if k != "draft_vocab"}
        missing, unexpected = head.load_state_dict(weights, strict=False)
        if unexpected or any(not k.startswith(("fuse", "feature_norms", "draft_vocab")) for k in missing):
            raise ValueError(
                f"cannot start from {config.init_from}: {missing} missing, {unexpected} unexpected"
            )
    head = head.float().bind(embed, lm_head)
    head.train()
    train_starts = _positions(train_spans)
    eval_starts = _positions(eval_spans)
    eval_starts = eval_starts[torch.randperm(len(eval_starts), generator=generator)[: config.eval_positions]]
    calibration_starts = _positions(calibration_spans)
    calibration_starts = calibration_starts[
        torch.randperm(len(calibration_starts), generator=generator)[: config.eval_positions]
    ]
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
        "training %d optimizer steps of %d start positions x %d unrolled positions",
        steps,
        config.batch_size,
        config.unroll,
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
    predicted: dict[str, dict] = {}
    if unseen:
        names = list(unseen)
        unseen_data, unseen_spans = load_data([unseen[n] for n in names], fused=config.fuse_layers)
        per_set = _spans_per_file(unseen_spans, [unseen[n] for n in names])
        fit_starts = _positions([s for spans_of in per_set for s in spans_of[0::2]])
        calibration = fit_confidence_temperature(head, unseen_data, fit_starts)
        calibration["on"] = "even-numbered answers of " + ", ".join(names)
    else:
        calibration = fit_confidence_temperature(head, data, calibration_starts)
        calibration["on"] = "held-out corpus answers"
    head.config = dataclasses.replace(head.config, confidence_temperature=calibration["temperature"])
    log.info("confidence calibration: %s", calibration)
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=False):
        held_out = evaluate(head, data, eval_starts, remap, config)
        if unseen:
            for name, spans_of in zip(names, per_set, strict=True):
                predicted[name] = evaluate(head, unseen_data, _positions(spans_of[1::2]), remap, config)
    log.info("held out: %s", held_out)
    log.info("predicted on unseen prompts: %s", predicted)
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
        "predicted_unseen": predicted,
        "confidence_calibration": calibration,
        "history": history,
        "seconds": round(time.perf_counter() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    head.save(out, extra={"training": "python -m training (see training.json)"})
    (out / "training.json").write_text(json.dumps(report, indent=1))
    (out / "README.md").write_text(model_card(report, head.config))
    return report


def model_card(report: dict, config: DraftHeadConfig) -> str:
    held = report["held_out"]
    calibration = report["confidence_calibration"]
    params = sum(
        v.numel()
        for k, v in RecurrentDraftHead(config, torch.zeros(config.draft_vocab_size)).state_dict().items()
        if k != "draft_vocab"
    )
    init = report["config"].get("init_from")
    start = (
        f"- Started from the head in `{init}` (its weights and draft vocabulary), fine-tuned on the data below.\n"
        if init
        else ""
    )
    # --shards: the corpus shards it trained on, named even where it is the default (which a corpus may outgrow)
    command = (
        f"python -m training --shards {len(report['data']['files'])}"
        + (
            f" --init-from {init} --lr {report['config']['lr']} --epochs {report['config']['epochs']:g}"
            if init
            else ""
        )
        + ("" if config.feature_layers else " --no-fuse-layers")
        + _shape_flags(report["config"])
        + (
            f" --epochs {report['config']['epochs']:g}"
            if not init and report["config"]["epochs"] != TrainConfig.epochs
            else ""
        )
    )
    features = (
        f"the target's final hidden state fused with the outputs of decoder layers {list(config.feature_layers)}\n(EAGLE-3's low, mid and high features)"
        if config.feature_layers
        else "the target's final hidden state"
    )
    return f"""# Recurrent draft head for {config.target_name}

A drafter for speculative decoding with SmolLM2-135M-Instruct (the csd-serve embedded model). Architecture:
`service/decoding/draft_head.py`: a recurrent head on {features}, ReDrafter-style, with a frequency-ranked
draft vocabulary. {params / 1e6:.1f} M parameters of its own; the token embeddings and LM-head rows are the
target's and are not stored here.

{start}- Data: self-distillation on a corpus the target wrote itself (`training/magpie.py`, Magpie): its own sampled
  user turns (open, under operator system prompts, multi-turn, grounded on passages, tool-style, code from shard 17) and its
  greedy answers. {report["data"]["answers"]} answers, {report["data"]["positions"]} positions. No third-party
  data; no user turn shares an 8-word sequence with any `bench/` prompt. Licence: Apache-2.0 (the target model,
  SmolLM2, is Apache-2.0; the corpus is its output).
- Draft vocabulary: {config.draft_vocab_size} tokens, covering {100 * report["data"]["draft_vocabulary_coverage"]:.1f} % of answer tokens.
- Training: {report["steps"]} optimizer steps of {report["config"]["batch_size"]} start positions x {report["config"]["unroll"]}
  unrolled drafted positions, AdamW lr {report["config"]["lr"]}, seed {report["config"]["seed"]},
  {report["seconds"]:.0f} s on {report["torch_threads"]} CPU thread(s); final training loss {report["final_loss"]}.
- Confidence: temperature {calibration["temperature"]} fitted on {calibration["positions"]} positions of
  {calibration["on"]} (expected calibration error {calibration["ece_before"]} -> {calibration["ece_after"]});
  the stop rule reads it.
{_predicted_lines(report)}- Held-out corpus answers (teacher-forced, {held["positions"]} positions): accuracy per drafted position
  {held["accuracy_per_step"]}; conditional acceptance {held["conditional_acceptance_per_step"]}; a full
  6-token draft would give {held["expected_tokens_per_forward_k6"]} tokens per target forward, serving with the
  stop rule {held["served_tokens_per_forward"]}.{_corpus_caveat(report)}
- Reproduce: `{command} --install` (docs/drafters.md).
"""


def _shape_flags(trained: dict) -> str:
    """The command line's flags for a head shaped unlike the default (an ablation), so its card reproduces it."""
    default = TrainConfig()
    flags = (
        ("--inner-size", "inner_size"),
        ("--blocks", "num_blocks"),
        ("--unroll", "unroll"),
        ("--draft-vocab", "draft_vocab"),
    )
    return "".join(
        f" {flag} {trained[field]}"
        for flag, field in flags
        if field in trained and trained[field] != getattr(default, field)
    )


def _served(figures: dict) -> str:
    return (
        f"{figures['served_tokens_per_forward']} tokens per target forward "
        f"({100 * figures['served_acceptance']:.1f} % of {figures['served_draft_length']} drafted tokens per "
        f"round accepted, {figures['positions']} positions)"
    )


def _predicted_lines(report: dict) -> str:
    """The card's prediction: from prompts people wrote where the run had them (training.unseen), else from
    held-out corpus answers."""
    predicted = report.get("predicted_unseen") or {}
    if not predicted:
        return (
            "- **Predicted for serving** (greedy, `--drafter head`, the head's stop rule simulated, "
            f"teacher-forced on held-out corpus answers): {_served(report['held_out'])}.\n"
        )
    from training.unseen import KINDS

    sets = "\n".join(
        f"  - {KINDS.get(name, name)} (`bench/data/{name}.jsonl`): {_served(figures)}"
        for name, figures in predicted.items()
    )
    return (
        "- **Predicted for serving** (greedy, `--drafter head`, the head's stop rule simulated, teacher-forced)\n"
        "  on prompts people wrote, which neither the corpus nor the confidence fit saw (the odd-numbered\n"
        "  prompts of each set; training.unseen):\n"
        f"{sets}\n"
    )


def _corpus_caveat(report: dict) -> str:
    if not report.get("predicted_unseen"):
        return ""
    return (
        "\n  The corpus is the target's own writing and easier than prompts people write: these figures are not "
        "the prediction."
    )
