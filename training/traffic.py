"""`python -m training --from-traffic DIR`: fine-tune a draft head on traffic the service recorded.

The service records, when its operator turns it on (`--record-traffic DIR`, service/traffic.py), each
finished generation's prompt token ids and the target's emitted ids. Those are self-distillation data for
the very prompts an operator's users send, which no shipped corpus has (docs/traffic-learning.md):

1. read the records; keep those of this target (`name@revision`), drop repeats and answers too short to
   teach anything;
2. hold out a seeded share of them by request (records of one prompt stay on one side);
3. teacher-forced target features of both sides (training.features.shard_features);
4. measure the starting head on the held-out side (training.train_head.evaluate: per-position acceptance and
   expected tokens per target forward of a 6-token draft), fine-tune it on the rest (`TrainConfig.init_from`:
   its weights and draft vocabulary, a lower lr), measure again; both go to `traffic.json` and the card.

The service then serves the new head without a restart: POST /v1/admin/reload_drafter {"folder": OUT}.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from service.traffic import read_traffic

if TYPE_CHECKING:  # torch and the models load after the arguments are read (`--help` stays fast)
    from service.executor.models import LoadedModel
    from training.train_head import TrainConfig

log = logging.getLogger(__name__)

# Fine-tuning defaults: a few epochs over a small set, a fifth of the from-scratch lr, a short warmup.
FINE_TUNE = {"epochs": 4.0, "lr": 2e-4, "warmup_steps": 10, "batch_size": 256, "holdout_share": 0.01}
MIN_ANSWER_TOKENS = 4


def fine_tune_config(**overrides: object) -> TrainConfig:
    from training.train_head import TrainConfig

    return TrainConfig(**{**FINE_TUNE, **overrides})  # type: ignore[arg-type]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fine-tuning on recorded traffic (training/traffic.py)")
    g.add_argument(
        "--from-traffic",
        type=Path,
        metavar="DIR",
        default=None,
        help="fine-tune the draft head on the traffic the service recorded in DIR (--record-traffic DIR)",
    )
    g.add_argument(
        "--head", type=Path, default=None, help="the head to start from (default: the shipped one)"
    )
    g.add_argument("--holdout", type=float, default=0.2, help="share of requests held out for the report")
    g.add_argument(
        "--out", type=Path, default=None, help="where the fine-tuned head goes (WORK/traffic-head)"
    )
    g.add_argument("--finetune-epochs", type=float, default=FINE_TUNE["epochs"])
    g.add_argument("--finetune-lr", type=float, default=FINE_TUNE["lr"])


def main(args: argparse.Namespace) -> dict:
    """The --from-traffic flow, from `python -m training`'s arguments."""
    import torch

    from service.decoding.draft_head import EMBEDDED_HEAD_DIR
    from service.executor.models import load_model

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    target = load_model(args.model)
    config = fine_tune_config(seed=args.seed, epochs=args.finetune_epochs, lr=args.finetune_lr)
    report = fine_tune(
        target,
        args.from_traffic,
        args.head or EMBEDDED_HEAD_DIR,
        args.out or args.work / "traffic-head",
        config,
        holdout=args.holdout,
    )
    print(json.dumps({k: report[k] for k in ("records", "before", "after", "out")}, indent=1))
    return report


def select_records(records: list[dict], target: LoadedModel) -> tuple[list[dict], dict[str, int]]:
    """The records fine-tuning can use: this target's, long enough, each (prompt, answer) once."""
    identity = target.identity
    kept, seen = [], set()
    skipped = {"other_model": 0, "short": 0, "repeat": 0}
    for record in records:
        if record.get("model") != identity:
            skipped["other_model"] += 1
            continue
        if not record.get("end_token_known", True):  # ended on one of several stop tokens: which is unknown
            skipped["unknown_end"] = skipped.get("unknown_end", 0) + 1
            continue
        if len(record["answer_ids"]) < MIN_ANSWER_TOKENS or len(record["prompt_ids"]) < 2:
            skipped["short"] += 1
            continue
        key = (tuple(record["prompt_ids"]), tuple(record["answer_ids"]))
        if key in seen:
            skipped["repeat"] += 1
            continue
        seen.add(key)
        kept.append({"prompt_ids": record["prompt_ids"], "answer_ids": record["answer_ids"]})
    return kept, skipped


def split_by_request(records: list[dict], holdout: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): a seeded share of the distinct prompts, with every answer to them, is held out."""
    prompts = sorted({tuple(r["prompt_ids"]) for r in records})
    random.Random(seed).shuffle(prompts)
    count = min(len(prompts) - 1, max(1, round(len(prompts) * holdout)))  # both sides get a prompt
    held = set(prompts[:count])
    return (
        [r for r in records if tuple(r["prompt_ids"]) not in held],
        [r for r in records if tuple(r["prompt_ids"]) in held],
    )


def held_out_acceptance(target: LoadedModel, head_dir: Path, feature_file: Path) -> dict:
    """Teacher-forced acceptance of the head in `head_dir` on every held-out position."""
    import torch

    from service.decoding.draft_head import RecurrentDraftHead
    from training.train_head import _positions, evaluate, load_data

    model = target.model
    head = RecurrentDraftHead.load(head_dir).float()
    head.bind(
        model.get_input_embeddings().weight.detach().float(), model.get_output_embeddings().weight.float()
    )
    data, spans = load_data([feature_file], fused=bool(head.config.feature_layers))
    starts = _positions(spans)
    return evaluate(head, data, starts, torch.empty(0, dtype=torch.long), fine_tune_config())


def fine_tune(
    target: LoadedModel,
    traffic: Path,
    head_dir: Path,
    out: Path,
    config: TrainConfig | None = None,
    *,
    holdout: float = 0.2,
) -> dict:
    import torch

    from training.features import shard_features
    from training.train_head import train

    config = config or fine_tune_config()
    started = time.perf_counter()
    records, skipped = select_records(list(read_traffic(traffic)), target)
    if len({tuple(r["prompt_ids"]) for r in records}) < 2:
        raise SystemExit(
            f"{traffic} holds {len(records)} usable records of {target.name} (skipped: {skipped}); "
            "it needs two distinct prompts at least; record more traffic first (csd serve --record-traffic DIR)"
        )
    train_records, held_records = split_by_request(records, holdout, config.seed)
    log.info(
        "%d usable records (skipped %s): %d to train on, %d held out by request",
        len(records),
        skipped,
        len(train_records),
        len(held_records),
    )
    work = out.parent / f"{out.name}-features"
    train_file, held_file = work / "train.safetensors", work / "held-out.safetensors"
    positions = {
        "train": shard_features(target, train_records, train_file),
        "held_out": shard_features(target, held_records, held_file),
    }
    before = held_out_acceptance(target, head_dir, held_file)
    log.info("held out, before: %s", before)
    trained = train(target, [train_file], out, replace(config, init_from=head_dir))
    after = held_out_acceptance(target, out, held_file)
    log.info("held out, after: %s", after)
    report = {
        "traffic": str(traffic),
        "start_head": str(head_dir),
        "out": str(out),
        "records": {
            "usable": len(records),
            "train": len(train_records),
            "held_out": len(held_records),
            "skipped": skipped,
        },
        "positions": positions,
        "holdout": holdout,
        "steps": trained["steps"],
        "before": before,
        "after": after,
        "seconds": round(time.perf_counter() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out / "traffic.json").write_text(json.dumps(report, indent=1))
    (out / "README.md").write_text(_card(report))
    return report


def _card(report: dict) -> str:
    before, after = report["before"], report["after"]
    return f"""# Draft head fine-tuned on recorded traffic

Started from `{report["start_head"]}` (its weights and draft vocabulary), fine-tuned by
`python -m training --from-traffic {report["traffic"]}` (training/traffic.py) on {report["records"]["train"]}
recorded generations ({report["positions"]["train"]} positions), {report["steps"]} optimizer steps,
{report["seconds"]:.0f} s on {report["torch_threads"]} CPU threads. Details: traffic.json, training.json.

Held out by request: {report["records"]["held_out"]} generations, {before["positions"]} positions (teacher-forced).

| | accuracy per drafted position | expected tokens per target forward (6-token draft) |
|---|---|---|
| before | {before["accuracy_per_step"]} | {before["expected_tokens_per_forward_k6"]} |
| after | {after["accuracy_per_step"]} | {after["expected_tokens_per_forward_k6"]} |

Serve it without a restart: `POST /v1/admin/reload_drafter {{"folder": "{report["out"]}"}}`.
"""
